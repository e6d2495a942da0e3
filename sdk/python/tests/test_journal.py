import json
import os
import tempfile
import unittest

from agentrun_step import Step
from agentrun_step.journal import (CHUNK_MAX_ENTRIES, EntryTooLarge, Journal, JournalFull,
                                   JournalMismatch, JournalRefused, JournalTakenOver,
                                   JournalUnknown, NotApplied, call_key)

from .fake_apiserver import FakeApiServer

PREFIX = "refund-refund-3fa2c1-r1-journal-"
STEP_KEY = "stepkey"
# 2026-12-06T14:00:00Z
CLOCK = 1796565600.0


def model_answer(text, inp=100, out=20, cached=0):
    return lambda req: ({"choices": [{"message": {"role": "assistant", "content": text}}]},
                        {"input": inp, "output": out, "cached": cached})


def never(*_):
    raise AssertionError("a recorded call was made again")


class JournalTest(unittest.TestCase):
    fence_first = True

    def setUp(self):
        self.api = FakeApiServer(fence_first=self.fence_first)
        self.addCleanup(self.api.close)

    def journal(self, attempt, max_bytes=1 << 20, prefix=PREFIX):
        token = self.api.token_for(prefix, attempt)
        return Journal(self.api.url, "shop", PREFIX, "refund", "uid-1", "refund", 1, attempt,
                       STEP_KEY, token=token, max_bytes=max_bytes, clock=lambda: CLOCK,
                       sleep=lambda s: None)

    def loop(self, j, model=None, refund=None):
        """A small agent loop: ask, look the order up, refund it (NonIdempotent)."""
        a = j.model({"model": "m", "messages": [{"role": "user", "content": "refund 4711"}]},
                    model or model_answer("look it up"))
        order = j.tool("call_1", "lookup_order", {"id": 4711}, "None",
                       lambda key: {"orderId": 4711, "amount": "23.90 EUR"})
        r = j.tool("call_2", "issue_refund", {"orderId": 4711}, "NonIdempotent",
                   refund or (lambda key: {"refundId": "re_1", "key": key}))
        return a, order, r


class RecordAndReplay(JournalTest):
    def test_call_keys_match_the_vectors_of_docs_journal_md(self):
        # Computed with `printf 'K\0id' | openssl dgst -sha256` (docs/journal.md).
        self.assertEqual(call_key("stepkey", "call_1"), "0ed9ffc913f10948baf0d9ce47391e7f")
        self.assertEqual(call_key("0123456789abcdef0123456789abcdef", "call_abc123"),
                         "3e3fe9b4ae2107749f6eac4ef0653153")
        self.assertEqual(call_key("k", "toolu_01A09q90qw90lq917835lq9"),
                         "114672f7ee8e42b9648ee81d11f0c179")

    def test_each_call_is_recorded_as_the_protocol_says(self):
        j = self.journal(1)
        self.loop(j)
        chunk = self.api.chunk(PREFIX + "0")
        self.assertEqual(chunk["metadata"]["labels"], {"agentrun.dev/run": "refund"})
        self.assertEqual(chunk["metadata"]["ownerReferences"],
                         [{"apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRun",
                           "name": "refund", "uid": "uid-1"}])
        spec = dict(chunk["spec"])
        entries = spec.pop("entries")
        self.assertEqual(spec, {"runName": "refund", "runUid": "uid-1", "step": "refund",
                                "planRevision": 1, "chunk": 0, "firstSeq": 0, "attempt": 1,
                                "sealed": False})
        m, lookup, refund = entries
        self.assertEqual(m["kind"], "Model")
        self.assertEqual((m["seq"], m["callId"], m["state"], m["name"], m["attempt"]),
                         (0, "model-0", "Done", "m", 1))
        self.assertEqual(m["tokens"], {"input": 100, "output": 20})
        self.assertEqual((m["startedAt"], m["finishedAt"]),
                         ("2026-12-06T14:00:00Z", "2026-12-06T14:00:00Z"))
        self.assertNotIn("key", m)
        # printf '%s' '{"args":{"id":4711},"name":"lookup_order"}' | sha256sum
        self.assertEqual(lookup["requestDigest"],
                         "c0470c80817a8ec9d4257341873c1f35c5e4233f73c27476e12e58bb8906b9fd")
        self.assertEqual((lookup["effect"], lookup["state"], lookup["key"]),
                         ("None", "Done", "0ed9ffc913f10948baf0d9ce47391e7f"))
        self.assertEqual(json.loads(lookup["response"]), {"orderId": 4711, "amount": "23.90 EUR"})
        self.assertEqual((refund["effect"], refund["state"], refund["callId"]),
                         ("NonIdempotent", "Done", "call_2"))
        self.assertEqual(j.tokens_new(), {"input": 100, "output": 20, "cached": 0})
        self.assertEqual((j.new, j.replayed), (3, 0))

    def test_a_new_attempt_replays_recorded_answers_without_calling(self):
        first = self.loop(self.journal(1))
        writes = len(self.api.writes)
        j = self.journal(2)
        again = self.loop(j, model=never, refund=never)
        self.assertEqual(again, first)
        self.assertEqual((j.replayed, j.new), (3, 0))
        self.assertEqual(j.tokens_new(), {"input": 0, "output": 0, "cached": 0})
        self.assertEqual(len(self.api.writes), writes, "a pure replay writes nothing")

    def test_a_changed_request_stops_with_a_mismatch_naming_the_position(self):
        self.loop(self.journal(1))
        j = self.journal(2)
        j.model({"model": "m", "messages": [{"role": "user", "content": "refund 4711"}]}, never)
        with self.assertRaises(JournalMismatch) as e:
            j.tool("call_1", "lookup_order", {"id": 4712}, "None", never)
        self.assertEqual(e.exception.seq, 1)
        self.assertRegex(str(e.exception), r"journal position 1: attempt 1 recorded tool call "
                                           r"'call_1' .* but this attempt asks tool call 'call_1'")
        with self.assertRaisesRegex(JournalMismatch, "position 0: .* model call 'model-0'"):
            self.journal(3).model({"model": "m", "messages": []}, never)

    def test_the_intent_is_recorded_before_a_non_idempotent_tool_runs(self):
        seen = {}

        def refund(key):
            seen["server"] = self.api.entries()[2]
            seen["key"] = key
            return {"refundId": "re_1"}

        self.loop(self.journal(1), refund=refund)
        intent = seen["server"]
        self.assertEqual((intent["state"], intent["callId"], intent["effect"], intent["attempt"]),
                         ("Intent", "call_2", "NonIdempotent", 1))
        self.assertNotIn("response", intent)
        # The tool gets the key the intent names: printf 'stepkey\0call_2' | openssl dgst -sha256
        self.assertEqual(intent["key"], "1afded976925277ce469e452d8c67054")
        self.assertEqual(seen["key"], "1afded976925277ce469e452d8c67054")
        self.assertEqual(self.api.entries()[2]["state"], "Done")

    def test_a_tool_that_is_not_non_idempotent_records_no_intent(self):
        def lookup(key):
            self.assertEqual(len(self.api.entries()), 1, "only the model call is recorded")
            return {"orderId": 4711}

        j = self.journal(1)
        j.model({"q": 1}, model_answer("a"))
        j.tool("call_1", "lookup_order", {"id": 4711}, "Idempotent", lookup)
        self.assertEqual([e["state"] for e in self.api.entries()], ["Done", "Done"])


class CallsThatMayHaveActed(JournalTest):
    def crashed_attempt(self):
        def crash(key):
            raise ConnectionResetError("the Pod was lost during the refund")

        with self.assertRaises(ConnectionResetError):
            self.loop(self.journal(1), refund=crash)
        self.assertEqual(self.api.entries()[2]["state"], "Intent")

    def test_an_intent_without_a_settlement_stops_the_next_attempt(self):
        self.crashed_attempt()
        j = self.journal(2)
        with self.assertRaises(JournalUnknown) as e:
            self.loop(j, model=never, refund=never)
        self.assertEqual(e.exception.seq, 2)
        self.assertIn(f"key {call_key(STEP_KEY, 'call_2')}", str(e.exception))
        self.assertIn("may have acted", str(e.exception))

    def test_a_call_settled_applied_returns_the_settled_answer(self):
        self.crashed_attempt()
        self.api.settle(PREFIX + "0", 2, "Applied", response='{"refundId":"re_9"}')
        _, _, r = self.loop(self.journal(2), model=never, refund=never)
        self.assertEqual(r, {"refundId": "re_9"})
        self.assertEqual(self.api.entries()[2]["state"], "Intent", "the settlement is the answer")

    def test_a_call_marked_succeeded_by_a_person_returns_who_settled_it(self):
        self.crashed_attempt()
        self.api.settle(PREFIX + "0", 2, "Applied", by="alice@example.com")
        _, _, r = self.loop(self.journal(2), model=never, refund=never)
        self.assertEqual(r, {"settled": "Applied", "by": "alice@example.com"})

    def test_a_call_settled_not_applied_runs_again_with_the_same_key_after_a_new_intent(self):
        self.crashed_attempt()
        self.api.settle(PREFIX + "0", 2, "NotApplied")
        seen = {}

        def refund(key):
            seen["key"], seen["entry"] = key, self.api.entries()[2]
            return {"refundId": "re_2"}

        j = self.journal(2)
        _, _, r = self.loop(j, model=never, refund=refund)
        self.assertEqual(r, {"refundId": "re_2"})
        self.assertEqual(seen["key"], call_key(STEP_KEY, "call_2"))
        self.assertEqual((seen["entry"]["state"], seen["entry"]["attempt"]), ("Intent", 2))
        done = self.api.entries()[2]
        self.assertEqual((done["state"], done["attempt"], json.loads(done["response"])),
                         ("Done", 2, {"refundId": "re_2"}))
        self.assertEqual((j.replayed, j.new), (2, 1))

    def test_a_call_called_again_after_not_applied_and_lost_again_is_not_called_a_third_time(self):
        self.crashed_attempt()
        self.api.settle(PREFIX + "0", 2, "NotApplied")
        lost = {}

        def refund_lost(key):
            lost["entry"] = self.api.entries()[2]
            raise KeyboardInterrupt("attempt 2 is lost during the call")

        with self.assertRaises(KeyboardInterrupt):
            self.loop(self.journal(2), model=never, refund=refund_lost)
        self.assertEqual((lost["entry"]["state"], lost["entry"]["attempt"]), ("Intent", 2))
        # Attempt 1's settlement does not answer attempt 2's intent.
        with self.assertRaises(JournalUnknown):
            self.loop(self.journal(3), model=never, refund=lambda key: self.fail("called a third time"))

    def test_a_tool_that_did_not_act_is_recorded_and_the_exception_goes_on(self):
        def refused(key):
            raise NotApplied("payments answered 503: the provider is down")

        j = self.journal(1)
        with self.assertRaisesRegex(NotApplied, "provider is down"):
            self.loop(j, refund=refused)
        e = self.api.entries()[2]
        self.assertEqual((e["state"], e["error"]), ("NotApplied", "payments answered 503: the provider is down"))
        # At the end of the journal, the next attempt calls it again at the same position.
        _, _, r = self.loop(self.journal(2), model=never, refund=lambda key: {"refundId": "re_3"})
        self.assertEqual(r, {"refundId": "re_3"})
        self.assertEqual([x["state"] for x in self.api.entries()], ["Done", "Done", "Done"])

    def test_a_not_applied_call_before_the_end_replays_as_not_applied(self):
        j = self.journal(1)
        with self.assertRaises(NotApplied):
            j.tool("call_1", "issue_refund", {"o": 1}, "NonIdempotent",
                   lambda key: (_ for _ in ()).throw(NotApplied("card declined")))
        j.model({"q": "tell the customer"}, model_answer("sorry"))
        j2 = self.journal(2)
        with self.assertRaisesRegex(NotApplied, "card declined"):
            j2.tool("call_1", "issue_refund", {"o": 1}, "NonIdempotent", never)
        self.assertEqual(j2.model({"q": "tell the customer"}, never)["choices"][0]["message"]["content"],
                         "sorry")


class Chunks(JournalTest):
    def test_a_full_chunk_is_sealed_and_the_next_call_opens_the_next_chunk(self):
        j = self.journal(1)
        for i in range(CHUNK_MAX_ENTRIES):
            j.model({"turn": i}, model_answer(f"answer {i}"))
        self.assertTrue(self.api.chunk(PREFIX + "0")["spec"]["sealed"], "the write that fills it seals it")
        writes = len(self.api.writes)
        j.model({"turn": 32}, model_answer("answer 32"))
        self.assertEqual([w[:2] for w in self.api.writes[writes:]], [("POST", PREFIX + "1")])
        c0, c1 = self.api.chunk(PREFIX + "0"), self.api.chunk(PREFIX + "1")
        self.assertEqual((len(c0["spec"]["entries"]), c0["spec"]["sealed"]), (32, True))
        self.assertEqual((c1["spec"]["firstSeq"], c1["spec"]["chunk"], c1["spec"]["sealed"]),
                         (32, 1, False))
        self.assertEqual([e["seq"] for e in c1["spec"]["entries"]], [32])
        self.assertIsNone(self.api.chunk(PREFIX + "2"))
        # A replay reads across chunks.
        j2 = self.journal(2)
        for i in range(CHUNK_MAX_ENTRIES + 1):
            j2.model({"turn": i}, never)
        self.assertEqual(j2.replayed, 33)

    def test_an_intent_filling_a_chunk_leaves_it_open_until_its_answer(self):
        j = self.journal(1)
        for i in range(CHUNK_MAX_ENTRIES - 1):
            j.model({"turn": i}, model_answer("a"))
        sealed_during = {}

        def refund(key):
            sealed_during["sealed"] = self.api.chunk(PREFIX + "0")["spec"]["sealed"]
            return {"ok": True}

        j.tool("call_x", "issue_refund", {}, "NonIdempotent", refund)
        self.assertFalse(sealed_during["sealed"], "the answer could not be written into a sealed chunk")
        self.assertTrue(self.api.chunk(PREFIX + "0")["spec"]["sealed"])

    def test_a_200_call_loop_writes_bytes_linear_in_the_calls(self):
        n = 200
        j = self.journal(1)
        for i in range(n):
            j.model({"turn": i}, model_answer(f"answer number {i:03d}"))
        one = max(len(json.dumps(e, separators=(",", ":"))) for e in self.api.entries())
        # Appending to one growing object would send n*(n+1)/2 entries (20100 here); chunks
        # of 32 send under 17 entries per call on average, plus each write's envelope.
        self.assertEqual(len(self.api.entries()), n)
        self.assertLess(self.api.received, 20 * n * (one + 40))
        self.assertGreater(n * (n + 1) // 2 * one, 3 * 20 * n * (one + 40),
                           "the bound tells linear from quadratic")


class Bounds(JournalTest):
    def test_a_call_that_would_pass_max_bytes_is_refused_with_the_numbers(self):
        j = self.journal(1, max_bytes=4096)
        j.model({"q": 1}, model_answer("x" * 3000))
        used = self.api.entries()[0]
        with self.assertRaises(JournalFull) as e:
            j.model({"q": 2}, model_answer("y" * 3000, inp=7, out=3))
        self.assertEqual(e.exception.limit, 4096)
        self.assertRegex(str(e.exception), r"journal position 1: recording this call \(\d+ bytes\) "
                                           r"would take the journal to \d+ bytes, past its maxBytes of 4096")
        self.assertEqual(self.api.entries(), [used], "nothing is cut or recorded")
        self.assertEqual(j.tokens_unrecorded(), {"input": 7, "output": 3, "cached": 0})

    def test_an_answer_over_128_kib_is_refused_never_cut(self):
        j = self.journal(1, max_bytes=8 << 20)
        with self.assertRaises(EntryTooLarge) as e:
            j.tool("call_1", "fetch_page", {"url": "u"}, "None", lambda key: "z" * (130 << 10))
        self.assertEqual((e.exception.size, e.exception.limit), (133122, 131072))
        self.assertIn("133122 bytes, over the 131072-byte limit", str(e.exception))
        self.assertEqual(self.api.entries(), [])


class Takeover(JournalTest):
    def test_a_newer_attempt_fences_an_older_one_still_running(self):
        old = self.journal(1)
        old.model({"q": 1}, model_answer("a"))
        new = self.journal(2)
        new.model({"q": 1}, never)
        new.model({"q": 2}, model_answer("b"))  # attempt 2 takes the journal over
        with self.assertRaises(JournalTakenOver) as e:
            old.model({"q": 2}, model_answer("c"))
        self.assertEqual((e.exception.attempt, e.exception.newer), (1, 2))
        self.assertIn("attempt 2 has taken this step's journal over; attempt 1 stops", str(e.exception))
        self.assertEqual([(x["attempt"], json.loads(x["response"])["choices"][0]["message"]["content"])
                          for x in self.api.entries()], [(1, "a"), (2, "b")])
        self.assertEqual(old.tokens_unrecorded(), {"input": 100, "output": 20, "cached": 0})

    def test_takeover_is_written_before_the_first_new_call(self):
        self.journal(1).model({"q": 1}, model_answer("a"))
        seen = {}

        def ask(req):
            seen["attempt"] = self.api.chunk(PREFIX + "0")["spec"]["attempt"]
            return {"a": 2}, None

        j = self.journal(2)
        j.model({"q": 1}, never)
        j.model({"q": 2}, ask)
        self.assertEqual(seen["attempt"], 2)

    def test_an_older_attempt_finds_a_newer_one_when_it_reads(self):
        self.journal(2).model({"q": 1}, model_answer("a"))
        with self.assertRaisesRegex(JournalTakenOver, "attempt 2 has taken"):
            self.journal(1).model({"q": 1}, never)

    def test_a_refusal_that_is_no_takeover_carries_the_servers_message(self):
        j = self.journal(1, prefix="other-step-journal-")
        with self.assertRaises(JournalRefused) as e:
            j.model({"q": 1}, never)
        self.assertEqual(e.exception.code, 403)
        self.assertIn("may write only chunks named other-step-journal-<n>", str(e.exception))

    def test_a_status_write_between_two_calls_is_read_and_the_call_recorded(self):
        j = self.journal(1)
        j.model({"q": 1}, model_answer("a"))
        self.api.settle(PREFIX + "0", 0, "Applied")  # bumps the resourceVersion under the step
        j.model({"q": 2}, model_answer("b"))
        self.assertEqual(len(self.api.entries()), 2)
        self.assertIn(409, [w[4] for w in self.api.writes])


class TakeoverWhenConflictComesFirst(Takeover):
    """The same, with the server answering 409 before the fence's 403."""
    fence_first = False


class OpenedFromTheEnvironment(unittest.TestCase):
    def test_from_env_reads_what_the_pod_gets(self):
        with tempfile.TemporaryDirectory() as d:
            token = os.path.join(d, "token")
            with open(token, "w") as f:
                f.write("tok\n")
            env = {"AGENTRUN_JOURNAL": PREFIX, "AGENTRUN_JOURNAL_MAX_BYTES": "65536",
                   "AGENTRUN_RUN_UID": "uid-1", "AGENTRUN_NAMESPACE": "shop",
                   "AGENTRUN_JOURNAL_TOKEN_FILE": token, "KUBERNETES_SERVICE_HOST": "fd00::1",
                   "KUBERNETES_SERVICE_PORT": "443", "AGENTRUN_RUN": "refund",
                   "AGENTRUN_STEP": "refund", "AGENTRUN_PLAN_REVISION": "1",
                   "AGENTRUN_ATTEMPT": "3", "AGENTRUN_IDEMPOTENCY_KEY": STEP_KEY}
            import ssl
            j = Journal.from_env(env, ssl_context=ssl.create_default_context())
            self.assertEqual(j.api.base, "https://[fd00::1]:443")
            self.assertEqual(j.api.path, "/apis/agentrun.dev/v1alpha1/namespaces/shop/stepjournals")
            self.assertEqual((j.prefix, j.attempt, j.plan_revision, j.max_bytes, j.run_uid),
                             (PREFIX, 3, 1, 65536, "uid-1"))
            self.assertEqual(j.api._token(), "tok")
            del env["AGENTRUN_JOURNAL"]
            with self.assertRaisesRegex(Exception, "AGENTRUN_JOURNAL is not set"):
                Journal.from_env(env)


class StepTokens(JournalTest):
    def step(self, d):
        ctx = os.path.join(d, "context.json")
        with open(ctx, "w") as f:
            f.write("{}")
        env = {"AGENTRUN_IDEMPOTENCY_KEY": STEP_KEY, "AGENTRUN_RUN": "refund",
               "AGENTRUN_STEP": "refund", "AGENTRUN_ATTEMPT": "1", "AGENTRUN_PLAN_REVISION": "1",
               "AGENTRUN_CONTEXT_FILE": ctx, "AGENTRUN_CALL_SEQ": "2", "AGENTRUN_CALL_ID": "call_2",
               "AGENTRUN_CALL_KEY": "abc"}
        s = Step.load(env, message_path=os.path.join(d, "msg"), handle_sigterm=False)
        s.journal = self.journal(1)
        return s

    def test_succeed_reports_only_tokens_spent_outside_the_journal(self):
        with tempfile.TemporaryDirectory() as d:
            s = self.step(d)
            s.model({"q": 1}, model_answer("a", inp=500, out=50))
            with self.assertRaises(EntryTooLarge):
                s.model({"q": 2}, lambda req: ({"blob": "x" * (129 << 10)}, {"input": 9, "output": 4}))
            s.succeed({"ok": True}, tokens={"input": 10, "output": 1})
            with open(os.path.join(d, "msg")) as f:
                msg = json.load(f)
        # 10/1 the step's own, 9/4 the call the journal could not record; never the 500/50.
        self.assertEqual(msg["tokens"], {"input": 19, "output": 5})
        # The journal's own, whole, for the operator to count once.
        self.assertEqual(msg["journalTokens"], {"input": 500, "output": 50})

    def test_a_step_derives_call_keys_and_names_the_call_a_probe_asks_about(self):
        with tempfile.TemporaryDirectory() as d:
            s = self.step(d)
            self.assertEqual(s.call_key("call_1"), "0ed9ffc913f10948baf0d9ce47391e7f")
            self.assertEqual((s.unknown_call.seq, s.unknown_call.call_id, s.unknown_call.key),
                             (2, "call_2", "abc"))


if __name__ == "__main__":
    unittest.main()
