//! The timeline's journaled calls: each call a mark inside its step's bar,
//! model and tool apart, NonIdempotent and unknown marked, with a tooltip;
//! on fixed StepJournal chunks (`support/journal_fixtures.rs`).

use agentrun_api::CallKind;
use kubectl_agentrun::console::{run_page, timeline};
use kubectl_agentrun::render::Related;

use crate::journal_fixtures::*;

fn at(s: i64) -> jiff::Timestamp {
    t(s).parse().unwrap()
}

#[test]
fn journaled_calls_are_marks_inside_the_steps_bar_with_a_tooltip() {
    let run = run(vec![checkpoint(1, 2, "Running", 25)]);
    let chunks = replayed_and_unknown();
    let tl = timeline::build(&run, &[], &[], &chunks, at(60));
    let lane = &tl.lanes[0];
    assert_eq!(lane.label, "agent r1");
    let marks: Vec<(i64, CallKind, String, jiff::Timestamp, jiff::Timestamp)> = lane
        .calls
        .iter()
        .map(|c| (c.seq, c.kind, c.class(), c.start, c.end))
        .collect();
    assert_eq!(
        marks,
        [
            (0, CallKind::Model, "call call-model".into(), at(10), at(11)),
            (1, CallKind::Tool, "call call-tool".into(), at(12), at(14)),
            (
                2,
                CallKind::Tool,
                "call call-tool call-nonidempotent".into(),
                at(15),
                at(15)
            ),
            (3, CallKind::Model, "call call-model".into(), at(30), at(31)),
            (
                4,
                CallKind::Tool,
                "call call-tool call-nonidempotent call-unknown".into(),
                at(33),
                at(33)
            ),
        ]
    );
    let labels: Vec<&str> = lane.calls.iter().map(|c| c.label.as_str()).collect();
    assert_eq!(
        labels,
        [
            "#0 model claude (model-0): Done, 120 tokens; recorded by attempt 1",
            "#1 tool lookup_order (toolu_01A09q90qw90lq917835lq9), Idempotent: Done, key k1; recorded by attempt 1",
            "#2 tool charge (call_pay), NonIdempotent: Applied (settled by alice), key k2; recorded by attempt 1",
            "#3 model claude (model-3): Done, 180 tokens; recorded by attempt 2",
            "#4 tool refund (call_refund), NonIdempotent: Unknown (may have acted; nobody has settled it), key 3e3fe9b4ae2107749f6eac4ef0653153; recorded by attempt 2",
        ]
    );
    let svg = tl.svg().into_string();
    // Axis from 0 s to 60 s: x = 170 + 820 · s / 60; a tool call in the
    // lower half of the lane (y 24 + 30 − 14), at least 2 units wide.
    assert!(
        svg.contains(r#"<rect class="call call-tool call-nonidempotent call-unknown" x="621.0" y="40.0" width="2.0" height="6" rx="1" data-seq="4" data-call="tool"><title>agent r1: #4 tool refund (call_refund), NonIdempotent: Unknown (may have acted; nobody has settled it)"#),
        "{svg}"
    );
    assert!(
        svg.contains(r#"<rect class="call call-model" x="306.7" y="32.0" width="13.7" height="6" rx="1" data-seq="0" data-call="model">"#),
        "{svg}"
    );
}

#[test]
fn the_run_page_explains_the_call_marks_only_when_there_are_some() {
    let run = run(vec![checkpoint(1, 2, "Running", 25)]);
    let chunks = replayed_and_unknown();
    let with = Related {
        journals: &chunks,
        ..Default::default()
    };
    let page = run_page::run_detail(&run, &with, true, at(60)).into_string();
    assert!(
        page.contains("Journaled calls inside a step&#39;s bar")
            || page.contains("Journaled calls inside a step's bar"),
        "{page}"
    );
    assert!(page.contains("call-unknown"), "{page}");
    let page = run_page::run_detail(&run, &Related::default(), true, at(60)).into_string();
    assert!(!page.contains("Journaled calls"), "{page}");
    assert!(!page.contains("class=\"call "), "{page}");
}
