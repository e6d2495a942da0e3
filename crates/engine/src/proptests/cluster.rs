//! What the rest of the cluster does to the run's Pods and Approvals: the
//! kubelet, users deleting Pods, someone force-removing one, people deciding.

use super::*;

/// Stamps every terminated container with the time it stopped.
pub(super) fn stopped_at(mut pod: Pod, at: Timestamp) -> Pod {
    for c in pod
        .status
        .iter_mut()
        .flat_map(|s| s.container_statuses.iter_mut().flatten())
    {
        if let Some(t) = c.state.as_mut().and_then(|s| s.terminated.as_mut()) {
            t.finished_at = Some(Time(at));
        }
    }
    pod
}

/// A Pod deleted before its container started: the kubelet never starts it.
pub(super) fn never_started(mut pod: Pod) -> Pod {
    pod.status = Some(PodStatus {
        phase: Some("Failed".into()),
        container_statuses: Some(vec![ContainerStatus {
            name: "step".into(),
            state: Some(ContainerState {
                waiting: Some(ContainerStateWaiting {
                    reason: Some("ContainerCreating".into()),
                    message: None,
                }),
                ..ContainerState::default()
            }),
            ..ContainerStatus::default()
        }]),
        ..PodStatus::default()
    });
    pod
}

impl Sim {
    /// Whether the API server holds this Pod's attempt as running: once
    /// the operator closed it, what happens to its Pod no longer decides
    /// whether the step runs again.
    pub(super) fn attempt_open(&self, pod: &Pod) -> bool {
        let l = pod.metadata.labels.as_ref().unwrap();
        let (key, attempt) = (&l[labels::IDEMPOTENCY_KEY], &l[labels::ATTEMPT]);
        let role = PodRole::from_label(&l[labels::ROLE]);
        self.w.status().steps.iter().any(|c| {
            &c.idempotency_key == key
                && Some(PodRole::from(c.role)) == role
                && c.attempt.to_string() == *attempt
                && c.phase == StepPhase::Running
        })
    }

    pub(super) fn pod_name(&self, which: usize) -> Option<String> {
        let names: Vec<&String> = self.w.pods.keys().collect();
        (!names.is_empty()).then(|| names[which % names.len()].clone())
    }

    /// The kubelet moves a Pod on. `ran`: its container runs or ran;
    /// `interrupted`: it was stopped from outside (evicted, or ended by a
    /// deletion).
    pub(super) fn kubelet_sets(&mut self, name: &str, next: Pod, ran: bool, interrupted: bool) {
        let next = stopped_at(next, self.w.now);
        let open = self.attempt_open(&next);
        let phase = next.status.as_ref().and_then(|s| s.phase.clone());
        let message = next
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|c| c.first())
            .and_then(|c| c.state.as_ref()?.terminated.as_ref()?.message.clone());
        let readable = message.as_deref().is_none_or(|m| {
            serde_json::from_str::<serde_json::Value>(m).is_ok_and(|v| v.is_object())
        });
        let said_not_applied = message
            .as_deref()
            .and_then(|m| serde_json::from_str::<serde_json::Value>(m).ok())
            .is_some_and(|v| v["effect"] == "NotApplied");
        if let Some(e) = self.ledger.get_mut(&uid(&next)) {
            e.started |= ran;
            e.said_not_applied |= said_not_applied;
            match phase.as_deref() {
                Some("Succeeded") if readable => e.succeeded = true,
                Some("Succeeded") => e.unreported_failure = ran,
                Some("Failed") if !interrupted => {
                    e.unreported_failure = ran && !said_not_applied;
                }
                _ => {}
            }
            e.interrupted |= interrupted && open;
            if interrupted && e.started && e.non_idempotent && open {
                e.disrupted = true;
            }
        }
        self.w.update_pod(name, |_| next);
        self.check_world();
    }

    pub(super) fn kubelet(&mut self, which: usize, what: u8) {
        let Some(name) = self.pod_name(which) else {
            return;
        };
        let pod = self.w.pod(&name);
        if !observe::is_live(&pod) {
            return;
        }
        let running = pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
        if let Some(gone_by) = pod.metadata.deletion_timestamp.clone() {
            // Deleted: a Pod that never started never will; a running one
            // gets SIGTERM and may finish its work, trap it and exit on its
            // own, or be killed once the grace period is over.
            let (next, ran) = if !running {
                (never_started(pod), false)
            } else if self.w.now >= gone_by.0 {
                (pod.exited(137, ""), true)
            } else {
                match what % 5 {
                    0 => return,
                    1 => (
                        pod.succeeded(&ok_message(serde_json::json!({"n": what}), 5)),
                        true,
                    ),
                    2 => (pod.exited(1, &ok_message(serde_json::Value::Null, 2)), true),
                    3 => (pod.exited(143, ""), true),
                    _ => (pod.exited(137, ""), true),
                }
            };
            let interrupted =
                next.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Failed");
            return self.kubelet_sets(&name, next, ran, interrupted);
        }
        let is_probe = pod
            .metadata
            .labels
            .as_ref()
            .map(|l| l[labels::ROLE].as_str())
            == Some("verify");
        let (next, interrupted) = match what {
            0 | 1 if !running => (pod.running(), false),
            1..=3 if is_probe => {
                let effect = ["Applied", "NotApplied", "Unknown"][usize::from(what - 1)];
                (
                    pod.succeeded(
                        &serde_json::json!({"effect": effect, "result": {"probe": what}})
                            .to_string(),
                    ),
                    false,
                )
            }
            0..=3 => (
                pod.succeeded(&ok_message(
                    serde_json::json!({"n": what}),
                    i64::from(what) * 7,
                )),
                false,
            ),
            4 => (pod.succeeded(""), false),
            5 => (
                pod.exited(1, &ok_message(serde_json::Value::Null, 3)),
                false,
            ),
            6 => (pod.evicted(running), true),
            7 => (pod.succeeded("not json"), false),
            8 => (
                pod.exited(
                    1,
                    r#"{"result": {"error": "declined"}, "effect": "NotApplied", "tokens": {"input": 1}}"#,
                ),
                false,
            ),
            _ => (pod.running(), false),
        };
        let ran = what != 6 || running;
        self.kubelet_sets(&name, next, ran, interrupted);
    }

    /// `kubectl delete pod`: the Pod stays until its containers stop and
    /// its finalizer is released.
    pub(super) fn user_delete(&mut self, which: usize) {
        let Some(name) = self.pod_name(which) else {
            return;
        };
        let now = self.w.now;
        let p = self.w.pods.get_mut(&name).unwrap();
        if p.metadata.deletion_timestamp.is_some() {
            return;
        }
        p.metadata.deletion_timestamp = Some(Time(
            now.checked_add(SignedDuration::from_secs(GRACE)).unwrap(),
        ));
        p.metadata.deletion_grace_period_seconds = Some(GRACE);
        self.w.gc();
    }

    pub(super) fn vanish(&mut self, which: usize) {
        let Some(name) = self.pod_name(which) else {
            return;
        };
        let p = self.w.pods.remove(&name).unwrap();
        // A Pod that already stopped on its own is not interrupted by this.
        let open = observe::is_live(&p) && self.attempt_open(&p);
        if let Some(e) = self.ledger.get_mut(&uid(&p)) {
            e.vanished = true;
            e.interrupted |= open;
            e.disrupted |= e.started && e.non_idempotent && open;
        }
    }

    pub(super) fn human(&mut self, which: usize, answer: bool, reconcile: u8) {
        let pending: Vec<String> = self
            .w
            .approvals
            .iter()
            .filter(|(_, a)| a.spec.decision.is_none())
            .map(|(n, _)| n.clone())
            .collect();
        if pending.is_empty() {
            return;
        }
        let name = pending[which % pending.len()].clone();
        let decision = match self.w.approvals[&name].spec.kind {
            ApprovalKind::Approve if answer => Answer::Approved,
            ApprovalKind::Approve => Answer::Rejected,
            ApprovalKind::Reconcile => {
                [Answer::Retry, Answer::MarkSucceeded, Answer::MarkFailed][reconcile as usize % 3]
            }
        };
        self.w.decide_approval(&name, decision, "someone");
    }
}

impl Sim {
    /// Someone sends a signal on one of the run's Signals. The API server
    /// refuses a sender the Signal does not name (the chart's admission
    /// policy, which reads the Signal's `senders`), and what `send_signal`
    /// refuses: another id once one was sent, anything once the Signal no
    /// longer waits. What it takes first is the signal, stamped with its time.
    pub(super) fn send(&mut self, which: usize, id: u8, data: u8, by: u8) {
        let names: Vec<String> = self.w.signals.keys().cloned().collect();
        if names.is_empty() {
            return;
        }
        let name = names[which % names.len()].clone();
        let by = if by == 0 { SENDER } else { INTRUDER };
        let spec = &self.w.signals[&name].spec;
        if spec
            .senders
            .as_ref()
            .is_some_and(|s| !s.users.iter().any(|u| u == by))
        {
            return;
        }
        let first = spec.id.is_none();
        let (id, data) = (format!("sig-{id}"), serde_json::json!({ "n": data }));
        if self.w.send_signal(&name, &id, data.clone(), by) && first {
            let at = self.w.now;
            self.sends.insert(
                name,
                Sent {
                    id,
                    data,
                    by: by.into(),
                    at,
                },
            );
        }
    }

    /// The controller's word on the caps on active runs: the run waits at
    /// `position`, or (`None`) it may start.
    pub(super) fn hold(&mut self, position: Option<u32>) {
        self.w.queued = position.map(|position| crate::Queued {
            position,
            why: "2 of 2 runs active in namespace default (maxActiveRunsPerNamespace)".into(),
        });
    }

    /// Whether `pod` is a step Pod of a step with a `resultSchema`.
    pub(super) fn has_schema(&self, pod: &Pod) -> bool {
        let l = pod.metadata.labels.as_ref().unwrap();
        l[labels::ROLE] == "step"
            && self
                .w
                .run
                .spec
                .steps
                .iter()
                .any(|s| s.name == l[labels::STEP] && s.result_schema.is_some())
    }
}
