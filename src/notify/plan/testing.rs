//! Approvals, channels and times the planning tests share.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

use crate::api::{Approval, ApprovalKind, ApprovalPhase, ApprovalSpec, ApprovalStatus, Delivery};
use crate::notify::channels::Channels;

pub(super) use crate::engine::testing::t;

pub(super) fn channels(yaml: &str) -> Channels {
    Channels::parse(
        "ops/chan",
        &BTreeMap::from([(
            super::super::channels::KEY.to_owned(),
            yaml.as_bytes().to_vec(),
        )]),
    )
}

pub(super) fn two() -> Channels {
    channels(
        "channels:\n- {name: oncall, url: 'https://a.example/', default: true}\n- {name: pay, url: 'https://b.example/'}\n- {name: boss, url: 'https://c.example/'}\n",
    )
}

pub(super) fn approval(notify: &[&str]) -> Approval {
    Approval {
        metadata: ObjectMeta {
            name: Some("r-s-approve".into()),
            namespace: Some("ns".into()),
            uid: Some("u1".into()),
            creation_timestamp: Some(Time(t(0))),
            ..ObjectMeta::default()
        },
        spec: ApprovalSpec {
            run_name: "r".into(),
            run_uid: "ru".into(),
            step: "s".into(),
            plan_revision: 1,
            kind: ApprovalKind::Approve,
            question: "May s run?".into(),
            context: None,
            expires_at: None,
            step_digest: None,
            on_timeout: Default::default(),
            decision: None,
            comment: None,
            approvers: None,
            quorum: 1,
            separate_from_requester: false,
            requested_by: None,
            decided_by: None,
            decided_by_groups: vec![],
            votes: vec![],
            notify: notify.iter().map(|s| s.to_string()).collect(),
            escalate: None,
        },
        status: None,
    }
}

pub(super) fn with(mut a: Approval, phase: ApprovalPhase, deliveries: Vec<Delivery>) -> Approval {
    a.status = Some(ApprovalStatus {
        phase,
        decided_at: (phase != ApprovalPhase::Pending).then(|| Time(t(50))),
        notifications: deliveries,
        ..ApprovalStatus::default()
    });
    a
}
