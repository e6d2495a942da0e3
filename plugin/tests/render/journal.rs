//! The journal views of `describe` and `logs` on fixed StepJournal chunks
//! (`support/journal_fixtures.rs`): replayed and new calls, a call that may
//! have acted, settled calls, sealed chunks, two plan revisions. Expected
//! output is literal.

use kubectl_agentrun::render::journal::{attempt_calls, journal_block, journals_of};
use kubectl_agentrun::render::{self, Style};

use crate::journal_fixtures::*;

const REPLAYED_AND_UNKNOWN: &str = "      Journal: 5 calls (2 model, 3 tool) in 2 chunks, 1 sealed
      190 B of 4 KiB, 300 tokens; attempt 2 replayed 3 calls of attempt 1
      SEQ  KIND   ID          NAME       EFFECT         STATE    TOKENS  BY
      0    model  model-0     claude     -              Done     120     a1
      1    tool   toolu_01A…  lookup_o…  Idempotent     Done     -       a1
      2    tool   call_pay    charge     NonIdempotent  Applied  -       a1
        ↳ settled Applied by alice at 2026-12-02T01:02:00Z
      3    model  model-3     claude     -              Done     180     a2
      4    tool   call_refu…  refund     NonIdempotent  Unknown  -       a2
      ! call 4 refund is Unknown: it may have acted, and nobody has settled it
        id call_refund  key 3e3fe9b4ae2107749f6eac4ef0653153
";

const FIRST_ATTEMPT: &str = "      Journal: 1 call (1 model, 0 tool) in 1 chunk
      33 B of 4 KiB, 120 tokens
      SEQ  KIND   ID       NAME    EFFECT  STATE  TOKENS  BY
      0    model  model-0  claude  -       Done   120     a1
";

const SETTLED_NOT_APPLIED: &str = "      Journal: 1 call (0 model, 1 tool) in 1 chunk
      18 B of 4 KiB, 0 tokens
      SEQ  KIND  ID        NAME    EFFECT         STATE       TOKENS  BY
      0    tool  call_pay  charge  NonIdempotent  NotApplied  -       a1
        ↳ settled NotApplied by verify at 2026-12-02T01:02:00Z
";

#[test]
fn a_steps_journal_block_says_what_was_replayed_recorded_settled_and_unknown() {
    let pay = || {
        tool(
            0,
            1,
            "call_pay",
            "charge",
            "NonIdempotent",
            "k2",
            "Intent",
            None,
            15,
        )
    };
    let cases = [
        (
            "a later attempt replayed the earlier one's calls; one call is unknown",
            2,
            replayed_and_unknown(),
            REPLAYED_AND_UNKNOWN,
        ),
        (
            "a first attempt replayed nothing",
            1,
            vec![chunk(
                "agent",
                1,
                0,
                1,
                false,
                vec![model(0, 1, (100, 20), r#"{"text":"look up"}"#, 10)],
                vec![],
            )],
            FIRST_ATTEMPT,
        ),
        (
            "an intent the verify probe settled NotApplied",
            1,
            vec![chunk(
                "agent",
                1,
                0,
                1,
                false,
                vec![pay()],
                vec![settled(0, "NotApplied", "verify", None)],
            )],
            SETTLED_NOT_APPLIED,
        ),
    ];
    for (name, attempt, chunks, want) in cases {
        let run = run(vec![checkpoint(1, attempt, "Running", 0)]);
        let journals = journals_of(&run, &chunks);
        assert_eq!(journals.len(), 1, "{name}");
        let got = journal_block(&journals[0], attempt, 4096, false, Style::default());
        assert_eq!(got, want, "{name}");
        for line in got.lines() {
            assert!(
                line.chars().count() <= 80,
                "{name}: wider than 80: {line:?}"
            );
        }
    }
}

#[test]
fn full_shows_whole_call_ids_and_names() {
    let chunks = replayed_and_unknown();
    let run = run(vec![checkpoint(1, 2, "Running", 0)]);
    let got = journal_block(
        &journals_of(&run, &chunks)[0],
        2,
        4096,
        true,
        Style::default(),
    );
    assert!(
        got.contains("      1    tool   toolu_01A09q90qw90lq917835lq9  lookup_order  Idempotent     Done     -       a1\n"),
        "{got}"
    );
}

#[test]
fn chunks_of_another_run_with_the_same_name_are_not_its_journal() {
    let mut chunks = replayed_and_unknown();
    chunks[1].spec.run_uid = "u0".into();
    let run = run(vec![checkpoint(1, 2, "Running", 0)]);
    let journals = journals_of(&run, &chunks);
    assert_eq!(journals[0].calls.len(), 3);
    assert_eq!(journals[0].chunks, 1);
}

#[test]
fn describe_puts_each_plan_revisions_journal_under_its_checkpoint() {
    let run = run(vec![
        checkpoint(1, 1, "Superseded", 0),
        checkpoint(2, 1, "Running", 40),
    ]);
    let chunks = [
        chunk(
            "agent",
            2,
            0,
            1,
            false,
            vec![model(0, 1, (10, 5), r#"{"text":"again"}"#, 41)],
            vec![],
        ),
        chunk(
            "agent",
            1,
            0,
            1,
            false,
            vec![model(0, 1, (100, 20), r#"{"text":"look up"}"#, 10)],
            vec![],
        ),
    ];
    let related = render::Related {
        journals: &chunks,
        ..Default::default()
    };
    let now = "2026-12-02T01:05:00Z".parse().unwrap();
    let out = render::describe(&run, &related, now, false, Style::default());
    let want = "Steps:
  ~ agent  r1 attempt 1  Superseded  effect -
      key key-r1
      pod crawl-agent-0960e3-r1-a1
      Journal: 1 call (1 model, 0 tool) in 1 chunk
      33 B of 4 KiB, 120 tokens
      SEQ  KIND   ID       NAME    EFFECT  STATE  TOKENS  BY
      0    model  model-0  claude  -       Done   120     a1
  ▶ agent  r2 attempt 1  Running  effect -
      key key-r2
      pod crawl-agent-0960e3-r2-a1
      Journal: 1 call (1 model, 0 tool) in 1 chunk
      31 B of 4 KiB, 15 tokens
      SEQ  KIND   ID       NAME    EFFECT  STATE  TOKENS  BY
      0    model  model-0  claude  -       Done   15      a1
";
    assert!(out.contains(want), "{out}");
}

#[test]
fn logs_show_each_attempts_replayed_and_recorded_calls() {
    let chunks = replayed_and_unknown();
    let run = run(vec![checkpoint(1, 2, "Running", 0)]);
    let j = &journals_of(&run, &chunks)[0];
    assert_eq!(
        attempt_calls(j, 1, false, Style::default()),
        "--- journal of step agent r1, attempt 1: recorded 3 calls ---
    SEQ  KIND   ID          NAME       EFFECT         STATE    TOKENS  BY
    0    model  model-0     claude     -              Done     120     a1
    1    tool   toolu_01A…  lookup_o…  Idempotent     Done     -       a1
    2    tool   call_pay    charge     NonIdempotent  Applied  -       a1
      ↳ settled Applied by alice at 2026-12-02T01:02:00Z
"
    );
    assert_eq!(
        attempt_calls(j, 2, false, Style::default()),
        "--- journal of step agent r1, attempt 2: replayed 3 calls, recorded 2 calls ---
    SEQ  KIND   ID          NAME    EFFECT         STATE    TOKENS  BY
    3    model  model-3     claude  -              Done     180     a2
    4    tool   call_refu…  refund  NonIdempotent  Unknown  -       a2
    ! call 4 refund is Unknown: it may have acted, and nobody has settled it
      id call_refund  key 3e3fe9b4ae2107749f6eac4ef0653153
"
    );
    let whole = attempt_calls(j, 1, true, Style::default());
    for want in [
        "    1    tool   toolu_01A09q90qw90lq917835lq9  lookup_order  Idempotent     Done     -       a1\n        response {\"order\":7}\n",
        "      ↳ settled Applied by alice at 2026-12-02T01:02:00Z\n        settled response {\"paid\":1}\n",
    ] {
        assert!(whole.contains(want), "{whole}");
    }
}

#[test]
fn an_unknown_call_is_painted_when_colour_is_on() {
    let chunks = replayed_and_unknown();
    let run = run(vec![checkpoint(1, 2, "Running", 0)]);
    let got = journal_block(
        &journals_of(&run, &chunks)[0],
        2,
        4096,
        false,
        Style { color: true },
    );
    assert!(
        got.contains("\x1b[1;31m! call 4 refund is Unknown: it may have acted, and nobody has settled it\x1b[0m"),
        "{got}"
    );
}
