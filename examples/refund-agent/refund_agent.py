#!/usr/bin/env python3
"""The example agent of config/samples, one subcommand per step.

The refund agent (config/samples/agentrun_refund.yaml):

    refund_agent.py lookup-order --order-id=4711
    refund_agent.py draft-refund
    refund_agent.py issue-refund --from-context=draft-refund
    refund_agent.py reverse-refund --from-context=issue-refund
    refund_agent.py notify-customer --template=refund-issued
    refund_agent.py verify-refund              (issue-refund's verify probe: asks the payments
                                                service for the refund made with the key)

Expert review, a fan-out and fan-in (config/samples/agentrun_expert_review.yaml):

    refund_agent.py parse-question --question="Why is the sky blue?"
    refund_agent.py expert --field=physics      (and --field=chemistry, in parallel)
    refund_agent.py aggregate

Email triage, conditional routing (config/samples/agentrun_email_triage.yaml):

    refund_agent.py detect-spam --subject="..." --body="..."
    refund_agent.py quarantine                   (runs when detect-spam says spam)
    refund_agent.py draft-reply                  (runs when it says not)

Expense reimbursement with parallel approvals (config/samples/agentrun_expense.yaml):

    refund_agent.py prepare-expense --expense-id=ex-77 --employee=e-12 --amount="120.00 EUR"
    refund_agent.py check --policy=budget        (and --policy=compliance, each behind its gate)
    refund_agent.py reimburse

The refund as one agent loop (a journaled step, docs/journal.md), with a model that calls
tools — the official openai package against $OPENAI_BASE_URL (examples/mock-model in tests):

    refund_agent.py refund-loop --order-id=4711  (lookup_order, check_policy, issue_refund,
                                                get_refund, notify_customer; each call journaled,
                                                each tool with its call's own key)
    refund_agent.py verify-call                 (its verify probe: was the refund made with
                                                $AGENTRUN_CALL_KEY?)

Each reads its inputs from the step context (agentrun_step SDK), talks to the payments
service at $PAYMENTS_API_URL with the step's idempotency key, and reports its result in the
termination message. A failed call exits non-zero: the attempt fails and is retried with
the same key, which the payments service answers with the first result. A request the
service refused (a 4xx answer, or 503 from a provider that is down) did not act, and the
step says so (`"effect": "NotApplied"`);
any other failure may have acted, and for issue-refund (NonIdempotent) the operator asks a
person before it runs again.

draft-refund stands in for an LLM call: it applies the refund policy as a rule and reports
the tokens a model call over the same prompt would be billed (prompt and answer length / 4),
so budgets and token accounting see realistic numbers without a model.
"""

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request

from agentrun_step import NotApplied, Step, StepError


class Refused(StepError):
    """The service refused the request, so nothing changed: a 4xx answer, or 503 (the
    provider is down and took nothing)."""

    def __init__(self, text, status=None):
        super().__init__(text)
        self.status = status


def call(method, url, body=None, headers=None, timeout=10):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.load(resp), resp.headers.get("Idempotent-Replayed") == "true"
    except urllib.error.HTTPError as e:
        text = f"{method} {url}: {e.code} {e.read()[:200].decode(errors='replace')}"
        if 400 <= e.code < 500 or e.code == 503:
            raise Refused(text, e.code) from None
        raise StepError(text) from None
    except (urllib.error.URLError, OSError) as e:
        raise StepError(f"{method} {url}: {getattr(e, 'reason', e)}") from None


def api():
    url = os.environ.get("PAYMENTS_API_URL")
    if not url:
        raise StepError("PAYMENTS_API_URL is not set")
    return url.rstrip("/")


def lookup_order(step, a):
    order, _ = call("GET", f"{api()}/orders/{a.order_id}")
    return {k: order[k] for k in ("orderId", "amount", "status", "customer", "note")}, None


def draft_refund(step, a):
    order = step.result_of("lookup-order")
    prompt = (f"Policy: refund delivered orders in full when the item arrived damaged.\n"
              f"Order: {json.dumps(order)}\nPropose amount and reason as JSON.")
    if order["status"] == "delivered" and "damaged" in order.get("note", ""):
        draft = {"orderId": order["orderId"], "amount": order["amount"],
                 "reason": "item arrived damaged", "confidence": 0.92}
    else:
        draft = {"orderId": order["orderId"], "amount": "0.00 EUR",
                 "reason": "policy does not cover this order", "confidence": 0.6}
    tokens = {"input": len(prompt) // 4, "output": len(json.dumps(draft)) // 4}
    return draft, tokens


def issue_refund(step, a):
    draft = step.result_of(a.from_context)
    refund, replayed = call("POST", f"{api()}/refunds",
                            {"orderId": draft["orderId"], "amount": draft["amount"]},
                            headers=step.headers())
    print(f"refund {refund['id']} {'replayed' if replayed else 'created'} "
          f"for key {step.idempotency_key}", flush=True)
    # A refund settles asynchronously; the step reports it once it has.
    deadline = time.monotonic() + a.settle_timeout
    # Polling is a read: a failed poll is retried until the deadline.
    while refund["state"] == "pending":
        if time.monotonic() > deadline:
            raise StepError(f"refund {refund['id']} still pending after {a.settle_timeout}s")
        time.sleep(0.5)
        try:
            refund, _ = call("GET", f"{api()}/refunds/{refund['id']}", timeout=5)
        except StepError as e:
            print(f"polling refund {refund['id']}: {e}; retrying", flush=True)
    return {"refundId": refund["id"], "orderId": refund["orderId"], "amount": refund["amount"],
            "state": refund["state"], "replayed": replayed}, None


def verify_refund(step, a):
    """issue-refund's verify probe: did an attempt with this key make a refund?"""
    url = f"{api()}/refunds?idempotencyKey={step.idempotency_key}"
    try:
        refund, _ = call("GET", url, timeout=5)
    except Refused as e:
        if e.status != 404:
            # The service cannot say (it is down): the outcome stays unknown.
            raise StepError(str(e)) from None
        # 404: the service made no refund with this key.
        return ("NotApplied", {"idempotencyKey": step.idempotency_key}), None
    return ("Applied", {"refundId": refund["id"], "orderId": refund["orderId"],
                        "amount": refund["amount"], "state": refund["state"], "replayed": True}), None


def reverse_refund(step, a):
    refund = step.result_of(a.from_context)
    out, _ = call("POST", f"{api()}/refunds/{refund['refundId']}/reversal", {},
                  headers=step.headers())
    return {"refundId": out["id"], "state": out["state"]}, None


def notify_customer(step, a):
    order = step.result_of("lookup-order")
    out, _ = call("POST", f"{api()}/notifications",
                  {"customer": order["customer"], "template": a.template}, headers=step.headers())
    return {"messageId": out["id"], "channel": out["channel"]}, None


# The "model" calls below stand in for LLM calls, as draft-refund does: a rule gives the
# answer, and the tokens a model call over the same prompt would bill are reported.
EXPERTS = {
    "physics": "Sunlight scatters off air molecules; short (blue) wavelengths scatter most "
               "(Rayleigh scattering, intensity ~ 1/wavelength^4).",
    "chemistry": "The scatterers are N2 and O2 molecules, far smaller than the wavelength; "
                 "ozone absorbs some orange light, deepening the blue at dusk.",
}


def _billed(prompt, answer):
    return {"input": len(prompt) // 4, "output": len(json.dumps(answer)) // 4}


def parse_question(step, a):
    q = a.question.strip()
    parsed = {"question": q, "topics": [f for f in EXPERTS if f in ("physics", "chemistry")]}
    return parsed, _billed(q, parsed)


def expert(step, a):
    q = step.result_of("parse-question")["question"]
    if a.field not in EXPERTS:
        raise Refused(f"no expert on {a.field}")
    answer = {"field": a.field, "answer": EXPERTS[a.field]}
    return answer, _billed(f"As an expert in {a.field}, answer: {q}", answer)


def aggregate(step, a):
    answers = [r["result"] for r in step.results if r.get("step", "").endswith(("physicist", "chemist"))]
    if len(answers) < 2:
        raise StepError(f"expected two expert answers in the context, got {len(answers)}")
    summary = {"question": step.result_of("parse-question")["question"],
               "answer": " ".join(x["answer"] for x in answers),
               "fields": [x["field"] for x in answers]}
    return summary, _billed(json.dumps(answers), summary)


# What the spam "model" looks for: a stand-in for a classifier call.
SPAM_WORDS = ("winner", "free money", "click here", "wire transfer", "lottery")


def detect_spam(step, a):
    text = f"{a.subject}\n{a.body}".lower()
    hits = [w for w in SPAM_WORDS if w in text]
    verdict = {"isSpam": bool(hits), "signals": hits, "subject": a.subject}
    return verdict, _billed(text, verdict)


def quarantine(step, a):
    d = step.result_of("detect-spam")
    return {"quarantined": d["subject"], "because": d["signals"]}, None


def draft_reply(step, a):
    d = step.result_of("detect-spam")
    reply = {"to": d["subject"], "reply": f"Thank you for your message about \"{d['subject']}\"; "
                                          "we will answer within one working day."}
    return reply, _billed(d["subject"], reply)


def prepare_expense(step, a):
    return {"expenseId": a.expense_id, "employee": a.employee, "amount": a.amount}, None


def check(step, a):
    # The manager's check comes before the claim is prepared.
    e = step.result_of("prepare-expense", {"expenseId": None})
    return {"policy": a.policy, "expenseId": e["expenseId"], "ok": True}, None


def reimburse(step, a):
    e = step.result_of("prepare-expense")
    out, replayed = call("POST", f"{api()}/payouts", e, headers=step.headers())
    return {"payoutId": out["id"], "state": out["state"], "replayed": replayed}, None


# The refund as a tool-calling loop. A tool gets its call's own key (derived from the step's
# key and the model's tool_call.id) and sends it as the Idempotency-Key of what it changes.
LOOP_TOOLS = [
    {"type": "function", "function": {
        "name": "lookup_order", "description": "The order: amount, status, customer, note.",
        "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                       "required": ["order_id"]}}},
    {"type": "function", "function": {
        "name": "check_policy", "description": "Whether the refund policy covers the order.",
        "parameters": {"type": "object", "properties": {
            "order_id": {"type": "string"}, "status": {"type": "string"},
            "note": {"type": "string"}}, "required": ["order_id", "status"]}}},
    {"type": "function", "function": {
        "name": "issue_refund", "description": "Refund an order. Acts: call once.",
        "parameters": {"type": "object", "properties": {
            "order_id": {"type": "string"}, "amount": {"type": "string"}},
            "required": ["order_id", "amount"]}}},
    {"type": "function", "function": {
        "name": "get_refund", "description": "A refund's state (pending, succeeded).",
        "parameters": {"type": "object", "properties": {"refund_id": {"type": "string"}},
                       "required": ["refund_id"]}}},
    {"type": "function", "function": {
        "name": "notify_customer", "description": "Tell the customer, from a template.",
        "parameters": {"type": "object", "properties": {
            "customer": {"type": "string"}, "template": {"type": "string"}},
            "required": ["customer", "template"]}}},
]
SYSTEM = ("You handle refunds for a shop. Look the order up, check the policy, refund what it "
          "covers, make sure the refund went through, tell the customer, then say what you did.")


def _refund_view(r):
    return {"refundId": r["id"], "orderId": r["orderId"], "amount": r["amount"], "state": r["state"]}


def loop_tools(step):
    """The loop's tools: name -> (effect, fn(args, key)). A refused request did not act."""
    def acting(key):
        return {**step.headers(), "Idempotency-Key": key}

    def refused_is_not_applied(fn):
        def run(args, key):
            try:
                return fn(args, key)
            except Refused as e:
                raise NotApplied(str(e)) from None
        return run

    def lookup_order(args, key):
        order, _ = call("GET", f"{api()}/orders/{args['order_id']}")
        return {k: order[k] for k in ("orderId", "amount", "status", "customer", "note")}

    def check_policy(args, key):
        ok = args.get("status") == "delivered" and "damaged" in args.get("note", "")
        return {"orderId": args["order_id"], "eligible": ok, "refund": "full" if ok else "none"}

    def issue_refund(args, key):
        refund, replayed = call("POST", f"{api()}/refunds",
                                {"orderId": args["order_id"], "amount": args["amount"]},
                                headers=acting(key))
        print(f"refund {refund['id']} {'replayed' if replayed else 'created'} for call key {key}",
              flush=True)
        return _refund_view(refund)

    def get_refund(args, key):
        refund, _ = call("GET", f"{api()}/refunds/{args['refund_id']}", timeout=5)
        return _refund_view(refund)

    def notify_customer(args, key):
        out, _ = call("POST", f"{api()}/notifications",
                      {"customer": args["customer"], "template": args["template"]},
                      headers=acting(key))
        return {"messageId": out["id"], "channel": out["channel"]}

    return {name: (effect, refused_is_not_applied(fn)) for name, effect, fn in (
        ("lookup_order", "None", lookup_order), ("check_policy", "None", check_policy),
        ("issue_refund", "NonIdempotent", issue_refund), ("get_refund", "None", get_refund),
        ("notify_customer", "Idempotent", notify_customer))}


def refund_loop(step, a):
    """The agent loop: ask the model, run the tools it calls, until it answers."""
    try:
        import openai
    except ImportError:
        raise StepError("the openai package is not installed (the refund-agent image has it)") from None
    from agentrun_step.openai_adapter import journaled, run_tool_calls

    base = os.environ.get("OPENAI_BASE_URL")
    if not base:
        raise StepError("OPENAI_BASE_URL is not set (examples/mock-model serves one)")
    client = journaled(openai.OpenAI(base_url=base, api_key=os.environ.get("OPENAI_API_KEY") or "unused"),
                       step.journal)
    tools = loop_tools(step)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Order {a.order_id}: the customer says the item "
                                            "arrived damaged. Please sort it out."}]
    for turn in range(a.max_turns):
        try:
            reply = client.chat.completions.create(model=a.model, messages=messages,
                                                   tools=LOOP_TOOLS, temperature=0)
        except openai.APIError as e:
            raise StepError(f"the model at {base}: {e}") from None
        msg = reply.choices[0].message
        messages.append(msg)
        if not msg.tool_calls:
            j = step.journal
            print(f"refund-loop: answered after {turn + 1} turns; {j.replayed} calls replayed, "
                  f"{j.new} made", flush=True)
            # The tokens are in the journal: succeed reports only those spent outside it.
            return {"answer": msg.content, "turns": turn + 1, "replayed": j.replayed,
                    "made": j.new}, None
        messages += run_tool_calls(step.journal, msg, tools)
    raise StepError(f"no answer after {a.max_turns} turns")


def verify_call(step, a):
    """refund-loop's verify probe, for the one call that may have acted: was a refund made
    with that call's key? The answer has the shape issue_refund returns."""
    c = step.unknown_call
    if c is None:
        raise StepError("AGENTRUN_CALL_KEY is not set: verify-call answers for one journaled call")
    try:
        refund, _ = call("GET", f"{api()}/refunds?idempotencyKey={c.key}", timeout=5)
    except Refused as e:
        if e.status != 404:
            raise StepError(str(e)) from None  # the service cannot say: unknown
        return ("NotApplied", {"callId": c.call_id, "key": c.key}), None
    return ("Applied", _refund_view(refund)), None


def main(argv=None):
    p = argparse.ArgumentParser(prog="refund-agent")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("lookup-order"); s.add_argument("--order-id", required=True)
    s.set_defaults(fn=lookup_order)
    s = sub.add_parser("draft-refund"); s.set_defaults(fn=draft_refund)
    s = sub.add_parser("issue-refund"); s.add_argument("--from-context", default="draft-refund")
    s.add_argument("--settle-timeout", type=float, default=60.0); s.set_defaults(fn=issue_refund)
    s = sub.add_parser("verify-refund"); s.set_defaults(fn=verify_refund)
    s = sub.add_parser("reverse-refund"); s.add_argument("--from-context", default="issue-refund")
    s.set_defaults(fn=reverse_refund)
    s = sub.add_parser("notify-customer"); s.add_argument("--template", default="refund-issued")
    s.set_defaults(fn=notify_customer)
    s = sub.add_parser("parse-question"); s.add_argument("--question", required=True)
    s.set_defaults(fn=parse_question)
    s = sub.add_parser("expert"); s.add_argument("--field", required=True); s.set_defaults(fn=expert)
    s = sub.add_parser("aggregate"); s.set_defaults(fn=aggregate)
    s = sub.add_parser("detect-spam"); s.add_argument("--subject", required=True)
    s.add_argument("--body", required=True); s.set_defaults(fn=detect_spam)
    s = sub.add_parser("quarantine"); s.set_defaults(fn=quarantine)
    s = sub.add_parser("draft-reply"); s.set_defaults(fn=draft_reply)
    s = sub.add_parser("prepare-expense"); s.add_argument("--expense-id", required=True)
    s.add_argument("--employee", required=True); s.add_argument("--amount", required=True)
    s.set_defaults(fn=prepare_expense)
    s = sub.add_parser("check"); s.add_argument("--policy", required=True); s.set_defaults(fn=check)
    s = sub.add_parser("reimburse"); s.set_defaults(fn=reimburse)
    s = sub.add_parser("refund-loop"); s.add_argument("--order-id", default="4711")
    s.add_argument("--model", default=os.environ.get("OPENAI_MODEL") or "mock-refund-1")
    s.add_argument("--max-turns", type=int, default=12); s.set_defaults(fn=refund_loop)
    s = sub.add_parser("verify-call"); s.set_defaults(fn=verify_call)
    a = p.parse_args(argv)

    try:
        step = Step.load()
    except StepError as e:
        print(f"refund-agent: {e}", file=sys.stderr)
        return 2
    print(f"refund-agent {a.cmd}: run {step.run} step {step.step} attempt {step.attempt} "
          f"key {step.idempotency_key}", flush=True)
    try:
        result, tokens = a.fn(step, a)
    except Refused as e:
        step.fail(e, not_applied=True)
    except StepError as e:
        step.fail(e)
    if step.is_verify:
        effect, seen = result
        step.answer(effect, seen, tokens=tokens)
        print(f"refund-agent {a.cmd}: {effect} {json.dumps(seen)}", flush=True)
        return 0
    step.succeed(result, tokens=tokens)
    print(f"refund-agent {a.cmd}: {json.dumps(result)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
