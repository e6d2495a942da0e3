//! Test fixtures: builders for runs, steps and Pods, and a small in-memory
//! cluster (`World`) that applies decisions the way the controller does —
//! status first, then the actions in order.

use std::collections::BTreeMap;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::{
    ContainerState, ContainerStateRunning, ContainerStateTerminated, ContainerStatus, Pod,
    PodCondition, PodStatus,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{FieldsV1, ManagedFieldsEntry, Time};

use super::{Action, Decision, Observed, Refusal, decide};
use agentrun_api::{AgentRun, AgentRunStatus, Approval, ApprovalPhase, Decision as Answer};

pub use agentrun_api::testing::{RUN, UID, container, step, t};

/// Moving a Pod through its life the way a kubelet reports it.
pub trait PodExt: Sized {
    fn running(self) -> Pod;
    /// Exit 0 with this termination message.
    fn succeeded(self, message: &str) -> Pod;
    fn exited(self, code: i32, message: &str) -> Pod;
    /// Evicted by the node: phase Failed, DisruptionTarget, reason Evicted.
    fn evicted(self, started: bool) -> Pod;
    fn deleting(self, at: Timestamp) -> Pod;
    /// The container's `finishedAt`, as the kubelet reports it.
    fn finished_at(self, at: Timestamp) -> Pod;
}

impl PodExt for Pod {
    fn running(mut self) -> Pod {
        self.status = Some(PodStatus {
            phase: Some("Running".into()),
            container_statuses: Some(vec![container_status(ContainerState {
                running: Some(ContainerStateRunning { started_at: None }),
                ..ContainerState::default()
            })]),
            ..PodStatus::default()
        });
        self
    }
    fn succeeded(self, message: &str) -> Pod {
        terminate(self, "Succeeded", 0, message)
    }
    fn exited(self, code: i32, message: &str) -> Pod {
        terminate(self, "Failed", code, message)
    }
    fn evicted(mut self, started: bool) -> Pod {
        let state = if started {
            ContainerState {
                terminated: Some(ContainerStateTerminated {
                    exit_code: 137,
                    ..Default::default()
                }),
                ..Default::default()
            }
        } else {
            ContainerState::default()
        };
        self.status = Some(PodStatus {
            phase: Some("Failed".into()),
            reason: Some("Evicted".into()),
            conditions: Some(vec![PodCondition {
                type_: "DisruptionTarget".into(),
                status: "True".into(),
                reason: Some("EvictionByEvictionAPI".into()),
                ..PodCondition::default()
            }]),
            container_statuses: Some(vec![container_status(state)]),
            ..PodStatus::default()
        });
        self
    }
    fn deleting(mut self, at: Timestamp) -> Pod {
        self.metadata.deletion_timestamp = Some(Time(at));
        self
    }
    fn finished_at(mut self, at: Timestamp) -> Pod {
        let term = self
            .status
            .as_mut()
            .and_then(|s| s.container_statuses.as_mut())
            .and_then(|c| c.first_mut())
            .and_then(|c| c.state.as_mut())
            .and_then(|s| s.terminated.as_mut())
            .expect("a terminated container");
        term.finished_at = Some(Time(at));
        self
    }
}

fn container_status(state: ContainerState) -> ContainerStatus {
    ContainerStatus {
        name: "step".into(),
        state: Some(state),
        ..ContainerStatus::default()
    }
}

fn terminate(mut pod: Pod, phase: &str, code: i32, message: &str) -> Pod {
    pod.status = Some(PodStatus {
        phase: Some(phase.into()),
        container_statuses: Some(vec![container_status(ContainerState {
            terminated: Some(ContainerStateTerminated {
                exit_code: code,
                message: (!message.is_empty()).then(|| message.to_owned()),
                reason: Some(if code == 0 { "Completed" } else { "Error" }.into()),
                ..ContainerStateTerminated::default()
            }),
            ..ContainerState::default()
        })]),
        ..PodStatus::default()
    });
    pod
}

/// A result message: `{"result": <result>, "tokens": {"input": n, "output": 0}}`.
pub fn ok_message(result: serde_json::Value, tokens: i64) -> String {
    serde_json::json!({"result": result, "tokens": {"input": tokens, "output": 0}}).to_string()
}

/// A failed attempt's message saying it did not act (D6).
pub const NOT_APPLIED: &str = r#"{"result": {"error": "declined"}, "effect": "NotApplied"}"#;

/// A deleted Pod's grace period (the Kubernetes default).
pub const GRACE_SECONDS: i64 = 30;

/// An in-memory cluster holding one run, applying decisions like the controller.
#[derive(Clone)]
pub struct World {
    pub run: AgentRun,
    pub pods: BTreeMap<String, Pod>,
    pub approvals: BTreeMap<String, Approval>,
    pub signals: BTreeMap<String, agentrun_api::Signal>,
    /// Journal chunks by name, as step Pods would write them (D19).
    pub journals: BTreeMap<String, agentrun_api::StepJournal>,
    /// Refusals the next decision is told about (what `apply` met).
    pub refused: Vec<Refusal>,
    pub now: Timestamp,
    pub run_deleted: bool,
    /// Every Pod name ever created, in order.
    pub created: Vec<String>,
    /// The run a fork starts from, as the cache shows it.
    pub source: Option<AgentRun>,
    /// Where the run waits under the caps on active runs, as the controller says.
    pub queued: Option<super::Queued>,
    /// What the run history says, as the controller says.
    pub history: super::History,
    next_uid: u64,
}

impl World {
    pub fn new(run: AgentRun) -> World {
        World {
            run,
            pods: BTreeMap::new(),
            approvals: BTreeMap::new(),
            signals: BTreeMap::new(),
            journals: BTreeMap::new(),
            refused: Vec::new(),
            now: t(0),
            run_deleted: false,
            created: Vec::new(),
            source: None,
            queued: None,
            history: super::History::Off,
            next_uid: 0,
        }
    }

    pub fn status(&self) -> AgentRunStatus {
        self.run.status.clone().unwrap_or_default()
    }

    /// Decides with a complete, fresh cache.
    pub fn decide(&self) -> Decision {
        let pods: Vec<Pod> = self.pods.values().cloned().collect();
        self.decide_with(&pods)
    }

    pub fn decide_with(&self, pods: &[Pod]) -> Decision {
        let approvals: Vec<Approval> = self.approvals.values().cloned().collect();
        let signals: Vec<agentrun_api::Signal> = self.signals.values().cloned().collect();
        let journals: Vec<agentrun_api::StepJournal> = self.journals.values().cloned().collect();
        decide(&Observed {
            run: &self.run,
            pods,
            approvals: &approvals,
            signals: &signals,
            journals: &journals,
            refused: &self.refused,
            source: self.source.as_ref(),
            queued: self.queued.clone(),
            history: self.history.clone(),
            now: self.now,
            cel: Default::default(),
        })
    }

    /// Writes the status (if changed) and applies the actions in order.
    pub fn commit(&mut self, d: &Decision) {
        if self.run.status.as_ref() != Some(&d.status) {
            self.run.status = Some(d.status.clone());
        }
        for a in &d.actions {
            self.apply(a);
        }
    }

    pub fn apply(&mut self, a: &Action) {
        match a {
            Action::CreatePod(pod) => {
                let name = pod.metadata.name.clone().unwrap();
                if !self.pods.contains_key(&name) {
                    let mut pod = (**pod).clone();
                    self.next_uid += 1;
                    pod.metadata.uid = Some(format!("pod-uid-{}", self.next_uid));
                    pod.metadata.creation_timestamp = Some(Time(self.now));
                    pod.status = Some(PodStatus {
                        phase: Some("Pending".into()),
                        ..PodStatus::default()
                    });
                    self.created.push(name.clone());
                    self.pods.insert(name, pod);
                }
            }
            Action::DeletePod { name, .. } => {
                // Like the API server: the deletion timestamp is when the
                // grace period ends.
                let gone_by = self
                    .now
                    .checked_add(SignedDuration::from_secs(GRACE_SECONDS))
                    .unwrap();
                if let Some(p) = self.pods.get_mut(name) {
                    if p.metadata.finalizers.as_ref().is_none_or(|f| f.is_empty()) {
                        self.pods.remove(name);
                    } else if p.metadata.deletion_timestamp.is_none() {
                        p.metadata.deletion_timestamp = Some(Time(gone_by));
                    }
                }
            }
            Action::ReleaseFinalizer { pod } => {
                if let Some(p) = self.pods.get_mut(pod) {
                    p.metadata.finalizers = None;
                }
                self.gc();
            }
            Action::CreateApproval(a) => {
                let name = a.metadata.name.clone().unwrap();
                self.approvals.entry(name).or_insert_with(|| (**a).clone());
            }
            Action::SetApprovalStatus {
                name,
                resource_version,
                status,
            } => {
                // Guarded like the API server: a changed Approval refuses it.
                if let Some(a) = self.approvals.get_mut(name)
                    && a.metadata.resource_version == *resource_version
                {
                    a.status = Some(status.clone());
                    a.metadata.resource_version = Some(format!("{}", self.next_uid));
                    self.next_uid += 1;
                }
            }
            Action::CreateSignal(s) => {
                let name = s.metadata.name.clone().unwrap();
                if !self.signals.contains_key(&name) {
                    let mut s = (**s).clone();
                    s.metadata.resource_version = Some(format!("{}", self.next_uid));
                    self.next_uid += 1;
                    self.signals.insert(name, s);
                }
            }
            Action::SetSignalStatus {
                name,
                resource_version,
                status,
            } => {
                if let Some(s) = self.signals.get_mut(name)
                    && s.metadata.resource_version == *resource_version
                {
                    s.status = Some(status.clone());
                    s.metadata.resource_version = Some(format!("{}", self.next_uid));
                    self.next_uid += 1;
                }
            }
            Action::SettleCall { chunk, settlement } => {
                if let Some(j) = self.journals.get_mut(chunk) {
                    let status = j.status.get_or_insert_with(Default::default);
                    if !status
                        .settlements
                        .iter()
                        .any(|s| (s.seq, s.attempt) == (settlement.seq, settlement.attempt))
                    {
                        status.settlements.push(settlement.clone());
                    }
                }
            }
            Action::DeleteRun => self.run_deleted = true,
            Action::Event { .. } => {}
        }
    }

    /// The API server removes a deleted Pod once it has stopped and has no finalizers.
    pub fn gc(&mut self) {
        self.pods.retain(|_, p| {
            p.metadata.deletion_timestamp.is_none()
                || p.metadata
                    .finalizers
                    .as_ref()
                    .is_some_and(|f| !f.is_empty())
                || super::observe::is_live(p)
        });
    }

    /// Decide and commit once.
    pub fn step(&mut self) -> Decision {
        let d = self.decide();
        self.commit(&d);
        d
    }

    /// Steps until the status stops changing (at most `n` decisions).
    pub fn settle(&mut self) -> Decision {
        for _ in 0..50 {
            let before = (
                self.status(),
                self.approvals.clone(),
                self.signals.clone(),
                self.journals.clone(),
            );
            let d = self.step();
            // An Approval's, Signal's or journal chunk's change wakes the
            // run too (their watches).
            if (
                d.status.clone(),
                self.approvals.clone(),
                self.signals.clone(),
                self.journals.clone(),
            ) == before
            {
                return d;
            }
        }
        panic!("the run did not settle: {:#?}", self.status());
    }

    pub fn advance(&mut self, secs: i64) {
        self.now = self
            .now
            .checked_add(SignedDuration::from_secs(secs))
            .unwrap();
    }

    pub fn pod(&self, name: &str) -> Pod {
        self.pods
            .get(name)
            .unwrap_or_else(|| panic!("no pod {name}; pods: {:?}", self.pods.keys()))
            .clone()
    }

    /// Replaces a Pod with what `f` makes of it (a kubelet update).
    pub fn update_pod(&mut self, name: &str, f: impl FnOnce(Pod) -> Pod) {
        let pod = f(self.pod(name));
        self.pods.insert(name.to_owned(), pod);
        self.gc();
    }

    /// Runs the Pod to success with this message, then settles.
    pub fn succeed(&mut self, name: &str, message: &str) {
        self.update_pod(name, |p| p.succeeded(message));
        self.settle();
    }

    /// A person decides, as the API server takes it: refused (false) once
    /// the Approval is no longer pending; stamped with the server's time.
    pub fn decide_approval(&mut self, name: &str, decision: Answer, manager: &str) -> bool {
        self.person_writes(name, manager, "f:decision", |a| {
            a.spec.decision = Some(decision)
        })
    }

    /// A person votes, as the API server takes it: refused (false) once the
    /// Approval is no longer pending; the votes stamped with the server's time.
    pub fn vote(&mut self, name: &str, user: &str, decision: Answer) -> bool {
        self.person_writes(name, "kubectl-patch", "f:votes", |a| {
            a.spec.votes.push(agentrun_api::Vote {
                user: user.into(),
                decision,
                comment: Some(format!("{user} says {decision:?}")),
            })
        })
    }

    /// An update of `spec.<field>` by `manager`, refused once the Approval is
    /// no longer pending, its managedFields entry stamped with the server's
    /// time.
    fn person_writes(
        &mut self,
        name: &str,
        manager: &str,
        field: &str,
        change: impl FnOnce(&mut Approval),
    ) -> bool {
        let now = self.now;
        let a = self
            .approvals
            .get_mut(name)
            .unwrap_or_else(|| panic!("no approval {name}"));
        if a.status
            .as_ref()
            .is_some_and(|s| s.phase != ApprovalPhase::Pending)
        {
            return false;
        }
        change(a);
        a.metadata.managed_fields = Some(vec![ManagedFieldsEntry {
            manager: Some(manager.into()),
            operation: Some("Update".into()),
            time: Some(Time(now)),
            fields_v1: Some(FieldsV1(serde_json::json!({"f:spec": {field: {}}}))),
            ..ManagedFieldsEntry::default()
        }]);
        a.metadata.resource_version = Some(format!("{}", self.next_uid));
        self.next_uid += 1;
        true
    }

    /// Someone sends a signal, as the API server takes it: refused (false)
    /// once the Signal no longer waits, or when it was already sent with
    /// another id or data; a repeat of the same is accepted and changes
    /// nothing. The write is stamped with the server's time.
    pub fn send_signal(&mut self, name: &str, id: &str, data: serde_json::Value, by: &str) -> bool {
        let now = self.now;
        let s = self
            .signals
            .get_mut(name)
            .unwrap_or_else(|| panic!("no signal {name}"));
        if let Some(sent) = &s.spec.id {
            return *sent == id && s.spec.data.as_ref() == Some(&data);
        }
        if s.status
            .as_ref()
            .is_some_and(|st| st.phase != agentrun_api::SignalPhase::Waiting)
        {
            return false;
        }
        s.spec.id = Some(id.into());
        s.spec.data = Some(data);
        s.spec.sent_by = Some(by.into());
        s.metadata.managed_fields = Some(vec![ManagedFieldsEntry {
            manager: Some("kubectl-agentrun".into()),
            operation: Some("Update".into()),
            time: Some(Time(now)),
            fields_v1: Some(FieldsV1(
                serde_json::json!({"f:spec": {"f:id": {}, "f:data": {}}}),
            )),
            ..ManagedFieldsEntry::default()
        }]);
        s.metadata.resource_version = Some(format!("{}", self.next_uid));
        self.next_uid += 1;
        true
    }

    pub fn live_pods(&self) -> Vec<String> {
        self.pods
            .iter()
            .filter(|(_, p)| super::observe::is_live(p))
            .map(|(n, _)| n.clone())
            .collect()
    }
}

/// A journaled call as a step SDK records it (D19): a model call answered,
/// a tool call answered, or a NonIdempotent tool call started and not
/// answered (`Intent`).
pub fn journal_entry(
    seq: i64,
    kind: agentrun_api::CallKind,
    state: agentrun_api::CallState,
) -> agentrun_api::JournalEntry {
    use agentrun_api::{CallKind, CallState, CallTokens, call_key};
    let call_id = format!("call_{seq}");
    agentrun_api::JournalEntry {
        seq,
        kind,
        request_digest: format!("{seq:064x}"),
        effect: (kind == CallKind::Tool).then_some(agentrun_api::Effect::NonIdempotent),
        key: (kind == CallKind::Tool).then(|| call_key("step-key", &call_id)),
        name: (kind == CallKind::Tool).then(|| "issue_refund".to_owned()),
        state,
        attempt: 1,
        response: (state == CallState::Done).then(|| r#"{"ok":true}"#.to_owned()),
        error: None,
        tokens: (kind == CallKind::Model).then_some(CallTokens {
            input: 100,
            output: 20,
            cached: 0,
        }),
        started_at: None,
        finished_at: None,
        call_id,
    }
}

impl World {
    /// The step's journal at `rev` holds `entries`, in one chunk, as its
    /// Pod would have written them.
    pub fn journal(&mut self, step: &str, rev: i64, entries: Vec<agentrun_api::JournalEntry>) {
        let name = self.run.metadata.name.clone().unwrap_or_default();
        let uid = self.run.metadata.uid.clone().unwrap_or_default();
        let chunk = format!("{}0", super::journal_prefix(&name, &uid, step, rev));
        let status = self.journals.get(&chunk).and_then(|j| j.status.clone());
        let mut j = agentrun_api::StepJournal::new(
            &chunk,
            agentrun_api::StepJournalSpec {
                run_name: name,
                run_uid: uid,
                step: step.to_owned(),
                plan_revision: rev,
                chunk: 0,
                first_seq: 0,
                attempt: 1,
                sealed: false,
                entries,
            },
        );
        j.status = status;
        self.journals.insert(chunk, j);
    }
}
