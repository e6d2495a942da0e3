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

from agentrun_step import Step, StepError


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
