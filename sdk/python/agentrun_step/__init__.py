"""The step side of agentrun-operator's step contract (docs/step-contract.md).

A step reads who it is from ``AGENTRUN_*`` environment variables and what came before from
the context file, does its work, and writes one JSON object to its termination message::

    from agentrun_step import Step

    step = Step.load()
    order = step.result_of("lookup-order")
    refund = payments.refund(order, idempotency_key=step.idempotency_key,
                             headers=step.headers())
    step.succeed({"refundId": refund["id"]}, tokens={"input": 820, "output": 140})

A step with ``journal: {}`` records each model and tool call of its loop in its journal
(``step.model``, ``step.tool``; docs/journal.md, ``agentrun_step.journal``), and a new
attempt replays what was recorded; ``agentrun_step.openai_adapter`` journals an ``openai``
client's chat completions.

Standard library only. The kubelet keeps at most 4096 bytes of a termination message and
cuts the rest, which the operator then cannot parse; ``succeed`` and ``fail`` refuse a
message over that limit with ``MessageTooLarge`` before anything is written.
"""

import json
import os
import signal
import sys

__all__ = ["Step", "StepError", "MessageTooLarge", "Terminated", "MAX_MESSAGE_BYTES",
           "EFFECTS", "encode_message", "write_message", "exit_on_sigterm", "UnknownCall",
           "Journal", "JournalError", "JournalMismatch", "JournalUnknown", "JournalTakenOver",
           "JournalFull", "EntryTooLarge", "JournalRefused", "NotApplied", "call_key"]

#: What the kubelet keeps of a termination message.
MAX_MESSAGE_BYTES = 4096
#: The Pod's default terminationMessagePath.
DEFAULT_MESSAGE_PATH = "/dev/termination-log"
DEFAULT_CONTEXT_FILE = "/agentrun/context.json"

ENV_IDEMPOTENCY_KEY = "AGENTRUN_IDEMPOTENCY_KEY"
ENV_RUN = "AGENTRUN_RUN"
ENV_STEP = "AGENTRUN_STEP"
ENV_ATTEMPT = "AGENTRUN_ATTEMPT"
ENV_PLAN_REVISION = "AGENTRUN_PLAN_REVISION"
ENV_CONTEXT_FILE = "AGENTRUN_CONTEXT_FILE"
#: Not set by the operator: lets tests and local runs write the message elsewhere.
ENV_MESSAGE_PATH = "AGENTRUN_TERMINATION_MESSAGE_PATH"
#: W3C trace context of the run, when the operator or the platform sets one.
ENV_TRACEPARENT = "TRACEPARENT"
ENV_TRACESTATE = "TRACESTATE"
#: A verify probe asked about one journaled call (docs/journal.md "A call that may have acted").
ENV_CALL_SEQ = "AGENTRUN_CALL_SEQ"
ENV_CALL_ID = "AGENTRUN_CALL_ID"
ENV_CALL_KEY = "AGENTRUN_CALL_KEY"


class StepError(Exception):
    """The step's environment or context does not follow the contract."""


class MessageTooLarge(StepError):
    """The termination message would exceed what the kubelet keeps (4096 bytes)."""

    def __init__(self, size, limit=MAX_MESSAGE_BYTES):
        super().__init__(
            f"termination message is {size} bytes, over the {limit}-byte limit: "
            "return a reference (e.g. an object key derived from the idempotency key) "
            "instead of the data")
        self.size = size
        self.limit = limit


class Terminated(SystemExit):
    """SIGTERM arrived (eviction, deletion, timeout): the attempt stops without a result."""

    def __init__(self):
        super().__init__(128 + signal.SIGTERM)


def _on_sigterm(signum, frame):
    raise Terminated()


def exit_on_sigterm():
    """Makes SIGTERM end the process (exit 143) by raising ``Terminated``.

    A container's first process is PID 1 of its namespace, and the kernel does not apply a
    signal's default action to PID 1: without a handler, SIGTERM is ignored and the kubelet
    kills the step only after the grace period (exit 137). ``Step.load`` installs this.
    """
    try:
        signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread: leave signals to the program
        pass


def _tokens(tokens):
    if tokens is None:
        return None
    if isinstance(tokens, dict):
        inp, out = tokens.get("input", 0), tokens.get("output", 0)
    else:
        inp, out = tokens
    for name, v in (("input", inp), ("output", out)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise StepError(f"tokens.{name} must be a non-negative integer, got {v!r}")
    return {"input": inp, "output": out}


#: What a step may say it did to the outside world (``effect`` in the message).
EFFECTS = ("Applied", "NotApplied", "Unknown")


def encode_message(result=None, tokens=None, plan=None, summary=None, effect=None,
                   journal_tokens=None):
    """The termination message as bytes, checked against the 4096-byte limit."""
    if effect is not None and effect not in EFFECTS:
        raise StepError(f"effect must be one of {', '.join(EFFECTS)}, got {effect!r}")
    msg = {"result": result}
    if effect is not None:
        msg["effect"] = effect
    t = _tokens(tokens)
    if t is not None:
        msg["tokens"] = t
    if plan is not None:
        msg["plan"] = plan
    if summary is not None:
        msg["summary"] = summary
    if journal_tokens is not None:
        msg["journalTokens"] = journal_tokens
    data = json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageTooLarge(len(data))
    return data


def write_message(data, path=None):
    """Writes an encoded message in one write (the contract: once, at the end)."""
    path = path or os.environ.get(ENV_MESSAGE_PATH) or DEFAULT_MESSAGE_PATH
    with open(path, "wb") as f:
        f.write(data)


class UnknownCall:
    """The journaled call a verify probe is asked about: its position, id and own key."""

    def __init__(self, seq, call_id, key):
        self.seq, self.call_id, self.key = seq, call_id, key

    def __repr__(self):
        return f"UnknownCall(seq={self.seq}, call_id={self.call_id!r}, key={self.key!r})"


class Step:
    """Who this attempt is (from the environment) and what it may use (the context file)."""

    def __init__(self, env, context, message_path=None):
        self.context = context
        self.idempotency_key = self._require(env, ENV_IDEMPOTENCY_KEY)
        self.run = self._require(env, ENV_RUN)
        self.step = self._require(env, ENV_STEP)
        self.attempt = self._int(env, ENV_ATTEMPT)
        self.plan_revision = self._int(env, ENV_PLAN_REVISION)
        self.traceparent = env.get(ENV_TRACEPARENT) or None
        self.tracestate = env.get(ENV_TRACESTATE) or None
        self.message_path = message_path or env.get(ENV_MESSAGE_PATH) or DEFAULT_MESSAGE_PATH
        self._env = env
        self._journal = None
        # The context's identity duplicates the environment; the environment wins.
        self.run_uid = context.get("runUid")
        self.role = context.get("role", "step")
        self.summary = context.get("summary")
        #: Earlier steps' committed results, oldest first: [{"step": name, "result": ...}].
        self.results = list(context.get("results") or [])
        #: How many older results were left out to stay within spec.context.maxBytes.
        self.omitted_results = int(context.get("omittedResults") or 0)
        self.written = False

    @classmethod
    def load(cls, env=None, message_path=None, handle_sigterm=True):
        """Reads the environment and the context file it names; with ``handle_sigterm``
        (the default) SIGTERM then ends the step promptly (see ``exit_on_sigterm``)."""
        if handle_sigterm:
            exit_on_sigterm()
        env = os.environ if env is None else env
        path = env.get(ENV_CONTEXT_FILE) or DEFAULT_CONTEXT_FILE
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise StepError(f"cannot read the context file {path}: {e.strerror}") from e
        try:
            context = json.loads(text) if text.strip() else {}
        except ValueError as e:
            raise StepError(f"the context file {path} is not JSON: {e}") from e
        if not isinstance(context, dict):
            raise StepError(f"the context file {path} holds {type(context).__name__}, not an object")
        return cls(env, context, message_path)

    @staticmethod
    def _require(env, name):
        v = env.get(name)
        if not v:
            raise StepError(f"{name} is not set: is this running as an agentrun step?")
        return v

    @staticmethod
    def _int(env, name):
        v = Step._require(env, name)
        try:
            return int(v)
        except ValueError:
            raise StepError(f"{name} must be an integer, got {v!r}") from None

    def result_of(self, name, default=None):
        """The committed result of an earlier step, by name (the newest one listed)."""
        for r in reversed(self.results):
            if r.get("step") == name:
                return r.get("result")
        if default is not None:
            return default
        raise StepError(f"no result of step {name!r} in the context "
                        f"(has: {', '.join(r.get('step', '?') for r in self.results) or 'none'})")

    def headers(self):
        """Headers for a request that changes an external system: the idempotency key, and
        the trace context when there is one."""
        h = {"Idempotency-Key": self.idempotency_key}
        if self.traceparent:
            h["traceparent"] = self.traceparent
            if self.tracestate:
                h["tracestate"] = self.tracestate
        return h

    @property
    def journal(self):
        """This step's journal (``journal: {}`` on the step), opened from the environment
        on first use."""
        if self._journal is None:
            self._journal = Journal.from_env(self._env)
        return self._journal

    @journal.setter
    def journal(self, journal):
        self._journal = journal

    def model(self, request, call, *, call_id=None, name=None):
        """A journaled model call (``Journal.model``)."""
        return self.journal.model(request, call, call_id=call_id, name=name)

    def tool(self, call_id, name, args, effect, call):
        """A journaled tool call (``Journal.tool``)."""
        return self.journal.tool(call_id, name, args, effect, call)

    def call_key(self, call_id):
        """A tool call's own idempotency key, derived from the step's key and the call id."""
        return call_key(self.idempotency_key, call_id)

    @property
    def unknown_call(self):
        """For a verify probe of a journaled step: the call that may have acted, else None."""
        key = self._env.get(ENV_CALL_KEY)
        if not key:
            return None
        seq = self._env.get(ENV_CALL_SEQ)
        return UnknownCall(int(seq) if seq and seq.isdigit() else None,
                           self._env.get(ENV_CALL_ID), key)

    def _outside_journal(self, tokens):
        """The tokens the message reports: a journaled call's are counted from the journal,
        so only the caller's own and those of calls the journal could not record."""
        if self._journal is None:
            return tokens
        extra = self._journal.tokens_unrecorded()
        if not (extra["input"] or extra["output"]):
            return tokens
        t = _tokens(tokens) or {"input": 0, "output": 0}
        return {"input": t["input"] + extra["input"], "output": t["output"] + extra["output"]}

    def _journal_tokens(self):
        """The journal's tokens (all its model calls, each once), if this attempt used it."""
        if self._journal is None:
            return None
        try:
            return self._journal.tokens_total()
        except Exception:  # a journal that could not be read reports nothing
            return None

    def _write(self, data):
        if self.written:
            raise StepError("the termination message was already written (write it once, at the end)")
        write_message(data, self.message_path)
        self.written = True

    def succeed(self, result=None, tokens=None, plan=None, summary=None):
        """Writes the result (and token usage) to the termination message; exit 0 after it.
        A journaled step passes only the tokens it spent outside the journal: journaled
        calls are counted from the journal, once, whichever attempt made them."""
        self._write(encode_message(result, self._outside_journal(tokens), plan, summary,
                                   journal_tokens=self._journal_tokens()))

    @property
    def is_verify(self):
        """Whether this attempt is a step's verify probe (``steps[].verify``): it runs with
        the step's idempotency key and asks the system the step changed what happened."""
        return self.role == "verify"

    def answer(self, effect, result=None, tokens=None):
        """A verify probe's answer: ``"Applied"`` (the step's attempt with this key acted;
        ``result`` becomes the step's result), ``"NotApplied"`` (it did not: the step may
        retry with the same key) or ``"Unknown"`` (a person is asked, and shown ``result``).
        Exit 0 after it."""
        if effect not in EFFECTS:
            raise StepError(f"effect must be one of {', '.join(EFFECTS)}, got {effect!r}")
        self._write(encode_message(result, tokens, effect=effect))

    def fail(self, reason, result=None, tokens=None, exit_code=1, not_applied=False):
        """Reports what is known (tokens count against the budget even on failure), prints
        the reason to stderr and exits non-zero.

        A failed attempt that does not say otherwise may have acted: the operator records
        its effect as Unknown, and a NonIdempotent step is then retried only after a person
        answers a Reconcile question. Pass ``not_applied=True`` only when the step knows
        nothing changed — the request was refused before it was sent, or the system it
        calls said it did not apply it: the attempt is then retried by the step's retry
        policy, with the same idempotency key."""
        if exit_code == 0:
            raise StepError("fail() needs a non-zero exit code")
        effect = "NotApplied" if not_applied else None
        tokens = self._outside_journal(tokens)
        partial = {"error": str(reason)}
        if isinstance(result, dict):
            partial.update(result)
        elif result is not None:
            partial["partial"] = result
        jt = self._journal_tokens()
        try:
            data = encode_message(partial, tokens, effect=effect, journal_tokens=jt)
        except MessageTooLarge:
            data = encode_message({"error": str(reason)[:1024]}, tokens, effect=effect,
                                  journal_tokens=jt)
        self._write(data)
        print(f"step {self.step} attempt {self.attempt} failed: {reason}", file=sys.stderr)
        sys.exit(exit_code)


# The journal needs StepError, defined above.
from .journal import (EntryTooLarge, Journal, JournalError, JournalFull,  # noqa: E402
                      JournalMismatch, JournalRefused, JournalTakenOver, JournalUnknown,
                      NotApplied, call_key)
