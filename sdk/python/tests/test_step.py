import io
import json
import os
import tempfile
import unittest
from contextlib import redirect_stderr

import signal
import time

from agentrun_step import (MAX_MESSAGE_BYTES, MessageTooLarge, Step, StepError, Terminated,
                           encode_message)

# The layout the operator writes (crates/engine/src/context.rs).
CONTEXT = {
    "run": "refund-order-4711",
    "runUid": "6f1c2b9e",
    "step": "issue-refund",
    "role": "step",
    "attempt": 2,
    "idempotencyKey": "9f3c6e1d0a7b4c28e5d1f6a0b3c9e7d2",
    "planRevision": 1,
    "results": [
        {"step": "lookup-order", "result": {"orderId": 4711}},
        {"step": "draft-refund", "result": {"amount": "23.90 EUR"}},
    ],
    "someFutureField": True,
}


class StepTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.ctx = os.path.join(self.dir.name, "context.json")
        self.msg = os.path.join(self.dir.name, "termination-log")
        with open(self.ctx, "w") as f:
            json.dump(CONTEXT, f)
        self.env = {
            "AGENTRUN_IDEMPOTENCY_KEY": "9f3c6e1d0a7b4c28e5d1f6a0b3c9e7d2",
            "AGENTRUN_RUN": "refund-order-4711",
            "AGENTRUN_STEP": "issue-refund",
            "AGENTRUN_ATTEMPT": "2",
            "AGENTRUN_PLAN_REVISION": "1",
            "AGENTRUN_CONTEXT_FILE": self.ctx,
        }

    def load(self, **extra):
        return Step.load({**self.env, **extra}, message_path=self.msg, handle_sigterm=False)

    def written(self):
        with open(self.msg, "rb") as f:
            return f.read()

    def test_identity_comes_from_the_environment_and_the_context(self):
        s = self.load()
        self.assertEqual(s.idempotency_key, "9f3c6e1d0a7b4c28e5d1f6a0b3c9e7d2")
        self.assertEqual((s.run, s.step, s.attempt, s.plan_revision),
                         ("refund-order-4711", "issue-refund", 2, 1))
        self.assertEqual((s.run_uid, s.role, s.omitted_results), ("6f1c2b9e", "step", 0))

    def test_result_of_an_earlier_step(self):
        s = self.load()
        self.assertEqual(s.result_of("draft-refund"), {"amount": "23.90 EUR"})
        with self.assertRaisesRegex(StepError, "no result of step 'notify'.*lookup-order, draft-refund"):
            s.result_of("notify")

    def test_missing_environment_is_refused_by_name(self):
        env = dict(self.env)
        del env["AGENTRUN_IDEMPOTENCY_KEY"]
        with self.assertRaisesRegex(StepError, "AGENTRUN_IDEMPOTENCY_KEY is not set"):
            Step.load(env)
        with self.assertRaisesRegex(StepError, "AGENTRUN_ATTEMPT must be an integer"):
            self.load(AGENTRUN_ATTEMPT="two")

    def test_context_that_is_not_json_is_refused(self):
        with open(self.ctx, "w") as f:
            f.write("{not json")
        with self.assertRaisesRegex(StepError, "is not JSON"):
            self.load()

    def test_succeed_writes_result_and_tokens_once(self):
        s = self.load()
        s.succeed({"refundId": "re_0001"}, tokens={"input": 820, "output": 140})
        self.assertEqual(json.loads(self.written()),
                         {"result": {"refundId": "re_0001"}, "tokens": {"input": 820, "output": 140}})
        with self.assertRaisesRegex(StepError, "already written"):
            s.succeed({"again": True})

    def test_a_message_over_4096_bytes_is_refused_before_writing(self):
        s = self.load()
        with self.assertRaises(MessageTooLarge) as e:
            s.succeed({"blob": "x" * 5000})
        self.assertIn("over the 4096-byte limit", str(e.exception))
        self.assertFalse(os.path.exists(self.msg))

    def test_the_limit_is_exactly_4096_bytes(self):
        overhead = len(encode_message(""))
        self.assertEqual(len(encode_message("x" * (MAX_MESSAGE_BYTES - overhead))), 4096)
        with self.assertRaises(MessageTooLarge):
            encode_message("x" * (MAX_MESSAGE_BYTES - overhead + 1))

    def test_bytes_not_characters_count(self):
        overhead = len(encode_message(""))
        with self.assertRaises(MessageTooLarge):
            encode_message("é" * (MAX_MESSAGE_BYTES - overhead))  # 2 bytes each in UTF-8

    def test_negative_tokens_are_refused(self):
        with self.assertRaisesRegex(StepError, "tokens.input must be a non-negative integer"):
            encode_message(None, {"input": -1, "output": 0})

    def test_fail_writes_a_partial_message_and_exits_non_zero(self):
        s = self.load()
        with redirect_stderr(io.StringIO()) as err, self.assertRaises(SystemExit) as e:
            s.fail("upstream 503", result={"pagesDone": 2}, tokens=(12, 3), exit_code=3)
        self.assertEqual(e.exception.code, 3)
        self.assertEqual(json.loads(self.written()),
                         {"result": {"error": "upstream 503", "pagesDone": 2},
                          "tokens": {"input": 12, "output": 3}})
        self.assertIn("failed: upstream 503", err.getvalue())

    def test_a_failure_says_it_did_not_act_only_when_told(self):
        s = self.load()
        with redirect_stderr(io.StringIO()), self.assertRaises(SystemExit):
            s.fail("card declined", not_applied=True)
        self.assertEqual(json.loads(self.written()),
                         {"result": {"error": "card declined"}, "effect": "NotApplied"})
        s = self.load()
        with redirect_stderr(io.StringIO()), self.assertRaises(SystemExit):
            s.fail("gateway timeout")
        self.assertNotIn("effect", json.loads(self.written()),
                         "a plain failure says nothing: it may have acted")

    def test_a_verify_probe_answers_with_an_effect_and_what_it_saw(self):
        s = self.load()
        s.answer("Applied", result={"refundId": "re_0001"})
        self.assertEqual(json.loads(self.written()),
                         {"result": {"refundId": "re_0001"}, "effect": "Applied"})
        with self.assertRaisesRegex(StepError, "effect must be one of"):
            self.load().answer("Maybe")

    def test_an_unknown_effect_name_is_refused(self):
        with self.assertRaisesRegex(StepError, "effect must be one of Applied, NotApplied, Unknown"):
            encode_message(None, effect="Done")

    def test_headers_carry_the_key_and_the_trace_context(self):
        self.assertEqual(self.load().headers(),
                         {"Idempotency-Key": "9f3c6e1d0a7b4c28e5d1f6a0b3c9e7d2"})
        tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        self.assertEqual(self.load(TRACEPARENT=tp).headers(),
                         {"Idempotency-Key": "9f3c6e1d0a7b4c28e5d1f6a0b3c9e7d2", "traceparent": tp})


class SigtermTest(unittest.TestCase):
    def test_sigterm_ends_the_step_with_exit_143_and_no_message(self):
        before = signal.getsignal(signal.SIGTERM)
        self.addCleanup(signal.signal, signal.SIGTERM, before)
        with tempfile.TemporaryDirectory() as d:
            ctx = os.path.join(d, "context.json")
            with open(ctx, "w") as f:
                json.dump(CONTEXT, f)
            env = {"AGENTRUN_IDEMPOTENCY_KEY": "k", "AGENTRUN_RUN": "r", "AGENTRUN_STEP": "s",
                   "AGENTRUN_ATTEMPT": "1", "AGENTRUN_PLAN_REVISION": "1",
                   "AGENTRUN_CONTEXT_FILE": ctx}
            msg = os.path.join(d, "termination-log")
            Step.load(env, message_path=msg)
            with self.assertRaises(Terminated) as e:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # the handler raises before this returns
            self.assertEqual(e.exception.code, 143)
            self.assertFalse(os.path.exists(msg))


if __name__ == "__main__":
    unittest.main()
