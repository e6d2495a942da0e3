"""Journaled chat completions and tool calls for the official ``openai`` client.

::

    import openai
    from agentrun_step import Step
    from agentrun_step.openai_adapter import journaled, run_tool_calls

    step = Step.load()
    client = journaled(openai.OpenAI(), step.journal)
    tools = {"lookup_order": ("None", lookup_order),          # fn(args, key) -> JSON value
             "issue_refund": ("NonIdempotent", issue_refund)}
    while True:
        reply = client.chat.completions.create(model=m, messages=messages, tools=schemas)
        msg = reply.choices[0].message
        messages.append(msg)
        if not msg.tool_calls:
            break
        messages += run_tool_calls(step.journal, msg, tools)

Each ``create`` is one model call of the journal: its digest covers the keyword arguments
that define the request (model, messages, tools, tool_choice, temperature, …; not
``timeout`` or ``extra_headers``), its answer is stored as ``ChatCompletion.model_dump()``
JSON and handed back, in the attempt that asked and in every replay alike, rebuilt with
``ChatCompletion.model_validate`` — so the loop sees the same message either way and the
next request's digest matches. Tokens come from ``usage`` (``prompt_tokens``,
``completion_tokens``, ``prompt_tokens_details.cached_tokens``). A tool call is keyed by
the model's ``tool_call.id``; its function gets the call's own idempotency key.

Anthropic's Messages API has the same shape: a ``tool_use`` block's ``id`` (``toolu_…``)
is the call id to pass to ``journal.tool``, and a ``Message`` is journaled with
``journal.model(request, lambda r: (msg.model_dump(mode="json"), tokens))`` and rebuilt
with ``Message.model_validate``.

``openai`` is imported only when a completion is rebuilt: the SDK's core stays
standard-library only.
"""

import json

from .journal import JournalError, NotApplied

__all__ = ["journaled", "JournaledClient", "JournaledCompletions", "run_tool_calls",
           "request_of", "tokens_of"]

#: Keyword arguments that change how a request travels, not what it asks.
TRANSPORT_KWARGS = frozenset({"timeout", "extra_headers"})


def _given(v):
    # openai's "not given" sentinels (NOT_GIVEN, omit) are left out of the request.
    return type(v).__name__ not in ("NotGiven", "Omit")


def _plain(x):
    """JSON values only: pydantic objects (a ChatCompletionMessage appended to messages) as
    the dict of their set, non-null fields."""
    if hasattr(x, "model_dump"):
        return _plain(x.model_dump(mode="json", exclude_none=True))
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items() if _given(v)}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def request_of(kwargs):
    """What a ``create`` call asks, as the journal digests it."""
    return {k: _plain(v) for k, v in kwargs.items() if k not in TRANSPORT_KWARGS and _given(v)}


def tokens_of(completion):
    """The tokens a ChatCompletion reports: input, output and cached (part of input)."""
    u = getattr(completion, "usage", None)
    if u is None:
        return {"input": 0, "output": 0, "cached": 0}
    details = getattr(u, "prompt_tokens_details", None)
    return {"input": u.prompt_tokens or 0, "output": u.completion_tokens or 0,
            "cached": (getattr(details, "cached_tokens", None) or 0) if details else 0}


class JournaledCompletions:
    """``chat.completions`` whose ``create`` goes through the journal."""

    def __init__(self, completions, journal):
        self._completions, self._journal = completions, journal

    def create(self, *, call_id=None, **kwargs):
        from openai.types.chat import ChatCompletion

        if kwargs.get("stream"):
            raise JournalError("a streamed completion is not journaled: call create without "
                               "stream=True (the journal records whole answers)")
        request = request_of(kwargs)

        def call(_request):
            reply = self._completions.create(**kwargs)
            return reply.model_dump(mode="json"), tokens_of(reply)

        data = self._journal.model(request, call, call_id=call_id, name=kwargs.get("model"))
        return ChatCompletion.model_validate(data)

    def __getattr__(self, name):
        return getattr(self._completions, name)


class _Chat:
    def __init__(self, chat, journal):
        self._chat = chat
        self.completions = JournaledCompletions(chat.completions, journal)

    def __getattr__(self, name):
        return getattr(self._chat, name)


class JournaledClient:
    """An ``openai.OpenAI`` client whose ``chat.completions.create`` is journaled; every
    other attribute is the client's own."""

    def __init__(self, client, journal):
        self._client = client
        self.chat = _Chat(client.chat, journal)

    def __getattr__(self, name):
        return getattr(self._client, name)


def journaled(client, journal):
    return JournaledClient(client, journal)


def run_tool_calls(journal, message, tools):
    """Runs the tool calls of an assistant message through the journal, in order, and
    returns the ``tool`` messages that answer them.

    ``tools`` maps a tool's name to ``(effect, fn)``: ``effect`` is ``"None"``,
    ``"Idempotent"`` or ``"NonIdempotent"``, and ``fn(args, key)`` does the work with the
    call's own idempotency key (send it as the ``Idempotency-Key`` of the request that
    changes something) and returns a JSON value, or raises ``NotApplied`` when the system
    refused (the model is told, and the loop goes on). A call to a tool the step does not
    have, or with arguments that are not JSON, is answered with an error and not
    journaled (the same model answer gives the same error in every attempt)."""
    out = []
    for tc in getattr(message, "tool_calls", None) or []:
        name = tc.function.name
        try:
            args = json.loads(tc.function.arguments or "{}")
        except ValueError as e:
            content = {"error": f"the arguments of {name} are not JSON: {e}"}
        else:
            if name not in tools:
                content = {"error": f"there is no tool named {name!r}"}
            else:
                effect, fn = tools[name]
                try:
                    content = journal.tool(tc.id, name, args, effect,
                                           lambda key, fn=fn, args=args: fn(args, key))
                except NotApplied as e:
                    content = {"error": str(e), "applied": False}
        out.append({"role": "tool", "tool_call_id": tc.id,
                    "content": content if isinstance(content, str) else json.dumps(content)})
    return out
