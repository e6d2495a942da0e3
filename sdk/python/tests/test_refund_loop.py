"""examples/refund-agent's refund-loop end to end, without the operator: the real openai
client against examples/mock-model, the example payments service, and the journal on the
fake API server. The operator's part (settling a call from the verify probe's answer) is
played by the test, as docs/journal.md describes it."""

import importlib.util
import json
import os
import sys
import threading
import unittest
from http.server import ThreadingHTTPServer
from types import SimpleNamespace
from unittest import mock

from agentrun_step import Step
from agentrun_step.journal import Journal, JournalUnknown

from .fake_apiserver import FakeApiServer
from .test_openai_adapter import mock_model  # noqa: F401 - also requires openai

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "..", "..", "examples", "refund-agent")
PREFIX = "refund-refund-3fa2c1-r1-journal-"
STEP_KEY = "9f3c6e1d0a7b4c28e5d1f6a0b3c9e7d2"


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLE, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


payments = load("payments")
refund_agent = load("refund_agent")


class Lost(BaseException):
    """The Pod is lost: nothing after this point of the attempt happens."""


class RefundLoopTest(unittest.TestCase):
    def setUp(self):
        self.api = FakeApiServer()
        self.addCleanup(self.api.close)
        self.model = mock_model.serve(mock_model.REFUND)
        self.addCleanup(self.model.server_close)
        self.addCleanup(self.model.shutdown)
        self.payments = ThreadingHTTPServer(("127.0.0.1", 0), payments.Handler)
        self.payments.ledger = payments.Ledger(0)
        threading.Thread(target=self.payments.serve_forever, args=(0.05,), daemon=True).start()
        self.addCleanup(self.payments.server_close)
        self.addCleanup(self.payments.shutdown)
        env = {"PAYMENTS_API_URL": f"http://127.0.0.1:{self.payments.server_address[1]}",
               "OPENAI_BASE_URL": self.model.url, "OPENAI_API_KEY": "unused"}
        patch = mock.patch.dict(os.environ, env)
        patch.start()
        self.addCleanup(patch.stop)
        quiet = mock.patch.object(payments.Handler, "log_message", lambda *a: None)
        quiet.start()
        self.addCleanup(quiet.stop)

    def step(self, attempt, role="step", **env):
        s = Step({"AGENTRUN_IDEMPOTENCY_KEY": STEP_KEY, "AGENTRUN_RUN": "refund",
                  "AGENTRUN_STEP": "refund", "AGENTRUN_ATTEMPT": str(attempt),
                  "AGENTRUN_PLAN_REVISION": "1", **env}, {"role": role})
        s.journal = Journal(self.api.url, "shop", PREFIX, "refund", "uid-1", "refund", 1, attempt,
                            STEP_KEY, token=self.api.token_for(PREFIX, attempt),
                            sleep=lambda s: None)
        return s

    def loop(self, step):
        return refund_agent.refund_loop(step, SimpleNamespace(order_id="4711", model="mock-refund-1",
                                                              max_turns=12))

    def ledger(self):
        return self.payments.ledger.snapshot()

    def test_a_refund_lost_mid_call_is_verified_settled_and_never_made_twice(self):
        real_call = refund_agent.call

        def lose_the_refund_answer(method, url, *a, **kw):
            out = real_call(method, url, *a, **kw)
            if method == "POST" and url.endswith("/refunds"):
                raise Lost()  # the refund was made; the attempt never learns it
            return out

        with mock.patch.object(refund_agent, "call", lose_the_refund_answer), \
                self.assertRaises(Lost):
            self.loop(self.step(1))
        self.assertEqual(len(self.model.model.requests), 3)
        intent = self.api.entries()[5]
        self.assertEqual((intent["name"], intent["state"]), ("issue_refund", "Intent"))

        # The next attempt may not guess: the call may have acted.
        with self.assertRaises(JournalUnknown):
            self.loop(self.step(2))
        self.assertEqual(len(self.model.model.requests), 3, "the model was not asked again")

        # The verify probe, for that call, finds the refund made with its key.
        probe = self.step(2, role="verify", AGENTRUN_CALL_SEQ="5",
                          AGENTRUN_CALL_ID=intent["callId"], AGENTRUN_CALL_KEY=intent["key"])
        (effect, seen), _ = refund_agent.verify_call(probe, None)
        self.assertEqual(effect, "Applied")
        self.assertEqual(seen, {"refundId": "re_0001", "orderId": 4711, "amount": "23.90 EUR",
                                "state": "succeeded"})
        self.api.settle(PREFIX + "0", 5, "Applied", response=json.dumps(seen))

        result, tokens = self.loop(self.step(3))
        self.assertEqual(result["answer"], "Refunded 23.90 EUR for order 4711 (refund re_0001, "
                                           "succeeded); the customer was told by email.")
        self.assertEqual((result["replayed"], result["made"]), (6, 6))
        self.assertIsNone(tokens, "the journal holds the tokens")
        self.assertEqual(len(self.model.model.requests), 6)
        ledger = self.ledger()
        self.assertEqual(len(ledger["refunds"]), 1, "one refund, whatever the attempts")
        self.assertEqual(ledger["refunds"][0]["idempotencyKey"], intent["key"])
        self.assertEqual(ledger["requestsByKey"][intent["key"]], 1)
        self.assertEqual(len(ledger["notifications"]), 1)

    def test_the_probe_says_not_applied_when_no_refund_has_the_key(self):
        probe = self.step(2, role="verify", AGENTRUN_CALL_SEQ="5", AGENTRUN_CALL_ID="call_x",
                          AGENTRUN_CALL_KEY="00000000000000000000000000000000")
        (effect, seen), _ = refund_agent.verify_call(probe, None)
        self.assertEqual((effect, seen), ("NotApplied", {"callId": "call_x",
                                                         "key": "00000000000000000000000000000000"}))

    def test_a_refund_the_provider_refused_is_recorded_not_applied_and_told_to_the_model(self):
        with mock.patch.dict(self.payments.ledger.__dict__, {"outage": ["/refunds"]}):
            result, _ = self.loop(self.step(1))
        refused = self.api.entries()[5]
        self.assertEqual((refused["name"], refused["state"]), ("issue_refund", "NotApplied"))
        self.assertIn("503", refused["error"])
        self.assertEqual(self.ledger()["refunds"], [])
        self.assertIsNotNone(result["answer"])


if __name__ == "__main__":
    sys.exit(unittest.main())
