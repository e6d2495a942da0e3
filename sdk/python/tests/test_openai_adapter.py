"""The openai adapter with the real ``openai`` package against examples/mock-model.

``make sdk-test`` installs the pinned package (sdk/python/requirements-openai.txt); without
it this module fails to import: it never passes by skipping."""

import importlib.util
import os
import unittest

try:
    import openai
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("these tests need the openai package: run `make sdk-test`, which "
                      "installs sdk/python/requirements-openai.txt") from e

from agentrun_step.journal import Journal, JournalMismatch, call_key
from agentrun_step.openai_adapter import journaled, request_of, run_tool_calls

from .fake_apiserver import FakeApiServer

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "mock_model", os.path.join(HERE, "..", "..", "..", "examples", "mock-model", "server.py"))
mock_model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mock_model)

PREFIX = "refund-refund-3fa2c1-r1-journal-"
STEP_KEY = "0123456789abcdef0123456789abcdef"
SYSTEM = "You are a careful refund agent. " + "Follow the refund policy exactly. " * 150
SCHEMAS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
           for n in ("lookup_order", "check_policy", "issue_refund", "get_refund",
                     "notify_customer")]


class Crash(Exception):
    """The Pod is lost."""


class Tools:
    def __init__(self, crash_on=None):
        self.calls, self.refund_keys, self.crash_on = [], [], crash_on

    def table(self):
        def tool(name, effect, answer):
            def fn(args, key):
                if name == self.crash_on:
                    raise Crash(name)
                self.calls.append(name)
                return answer(args, key)
            return effect, fn

        def refund(args, key):
            self.refund_keys.append(key)
            return {"refundId": "re_0001", "orderId": 4711, "amount": args["amount"],
                    "state": "pending"}

        return {
            "lookup_order": tool("lookup_order", "None", lambda a, k: {
                "orderId": 4711, "amount": "23.90 EUR", "status": "delivered",
                "customer": "c-1029", "note": "item arrived damaged"}),
            "check_policy": tool("check_policy", "None", lambda a, k: {"eligible": True}),
            "issue_refund": tool("issue_refund", "NonIdempotent", refund),
            "get_refund": tool("get_refund", "None", lambda a, k: {
                "refundId": a["refund_id"], "state": "succeeded"}),
            "notify_customer": tool("notify_customer", "Idempotent", lambda a, k: {
                "messageId": "msg-00001", "channel": "email"}),
        }


class OpenAIAdapterTest(unittest.TestCase):
    def setUp(self):
        self.api = FakeApiServer()
        self.addCleanup(self.api.close)
        self.model = mock_model.serve(mock_model.REFUND)
        self.addCleanup(self.model.server_close)
        self.addCleanup(self.model.shutdown)

    def journal(self, attempt):
        return Journal(self.api.url, "shop", PREFIX, "refund", "uid-1", "refund", 1, attempt,
                       STEP_KEY, token=self.api.token_for(PREFIX, attempt), sleep=lambda s: None)

    def requests(self):
        return list(self.model.model.requests)

    def loop(self, journal, tools, **extra):
        client = journaled(openai.OpenAI(base_url=self.model.url, api_key="unused",
                                         max_retries=0), journal)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "Order 4711 arrived damaged; refund it."}]
        for _ in range(10):
            reply = client.chat.completions.create(model="mock-refund-1", messages=messages,
                                                   tools=SCHEMAS, temperature=0, **extra)
            msg = reply.choices[0].message
            messages.append(msg)
            if not msg.tool_calls:
                return msg.content
            messages += run_tool_calls(journal, msg, tools.table())
        raise AssertionError("the loop did not finish")

    def test_a_second_attempt_replays_the_whole_loop_without_the_model_or_the_tools(self):
        tools = Tools()
        j1 = self.journal(1)
        answer = self.loop(j1, tools)
        self.assertEqual(answer, "Refunded 23.90 EUR for order 4711 (refund re_0001, succeeded); "
                                 "the customer was told by email.")
        self.assertEqual(len(self.requests()), 6)
        self.assertEqual(tools.calls, ["lookup_order", "check_policy", "issue_refund",
                                       "get_refund", "notify_customer", "get_refund"])
        self.assertEqual((j1.new, j1.replayed), (12, 0))

        again = Tools()
        j2 = self.journal(2)
        self.assertEqual(self.loop(j2, again), answer)
        self.assertEqual(len(self.requests()), 6, "the model was not asked again")
        self.assertEqual(again.calls, [], "no tool was called again")
        self.assertEqual((j2.new, j2.replayed), (0, 12))
        self.assertEqual(j2.tokens_new(), {"input": 0, "output": 0, "cached": 0})

    def test_an_attempt_lost_mid_loop_resumes_with_the_recorded_tool_call_ids(self):
        first = Tools(crash_on="get_refund")
        with self.assertRaises(Crash):
            self.loop(self.journal(1), first)
        self.assertEqual(first.calls, ["lookup_order", "check_policy", "issue_refund"])
        asked = len(self.requests())
        self.assertEqual(asked, 4)
        recorded_id = self.requests()[2]["reply"]["choices"][0]["message"]["tool_calls"][0]["id"]

        second = Tools()
        j2 = self.journal(2)
        self.loop(j2, second)
        self.assertEqual(second.calls, ["get_refund", "notify_customer", "get_refund"])
        self.assertEqual(len(self.requests()) - asked, 2, "only the turns after the loss")
        self.assertEqual(first.refund_keys, [call_key(STEP_KEY, recorded_id)])
        self.assertEqual(second.refund_keys, [], "the refund is made once")
        self.assertEqual((j2.replayed, j2.new), (7, 5))

    def test_tokens_are_the_usage_the_model_reported_each_counted_once(self):
        with self.assertRaises(Crash):
            self.loop(self.journal(1), Tools(crash_on="notify_customer"))
        j2 = self.journal(2)
        self.loop(j2, Tools())
        usage = [r["reply"]["usage"] for r in self.requests()]
        recorded = [e["tokens"] for e in self.api.entries() if e["kind"] == "Model"]
        self.assertEqual(recorded, [
            {"input": u["prompt_tokens"], "output": u["completion_tokens"],
             **({"cached": u["prompt_tokens_details"]["cached_tokens"]}
                if u["prompt_tokens_details"]["cached_tokens"] else {})} for u in usage])
        self.assertGreater(sum(t.get("cached", 0) for t in recorded), 0,
                           "a long system prompt is served from the cache on later turns")
        later = usage[4:]
        self.assertEqual(j2.tokens_new(), {
            "input": sum(u["prompt_tokens"] for u in later),
            "output": sum(u["completion_tokens"] for u in later),
            "cached": sum(u["prompt_tokens_details"]["cached_tokens"] for u in later)})

    def test_the_digest_covers_what_is_asked_not_how_it_travels(self):
        kw = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        self.assertEqual(request_of({**kw, "timeout": 5, "extra_headers": {"X-Trace": "1"}}),
                         request_of(kw))
        self.assertEqual(request_of({**kw, "top_p": openai.NOT_GIVEN}), request_of(kw))
        self.loop(self.journal(1), Tools())
        with self.assertRaisesRegex(JournalMismatch, "journal position 0"):
            self.loop(self.journal(2), Tools(), top_p=0.5)


if __name__ == "__main__":
    unittest.main()
