"""What each framework reports as usage, as ``record_usage`` arguments (duck-typed: no framework is imported).

- openai-agents: each ``ModelResponse`` of a run (``RunResult.raw_responses``) has a ``usage`` (``input_tokens``
  with the cached ones inside, ``input_tokens_details.cached_tokens``, ``output_tokens_details.reasoning_tokens``)
  and a ``response_id``; ``context_wrapper.usage`` is the run's sum, so the per-response ones are recorded.
- Agent Framework: ``AgentResponse.usage_details`` (``input_token_count``, ``output_token_count``,
  ``cache_read_input_token_count``, ...), ``response_id``, the model where the client says (``ChatResponse.model``, on the agent's response
  as its ``raw_representation``).
- AutoGen: ``CreateResult.usage`` (a ``RequestUsage``: ``prompt_tokens``, ``completion_tokens``); an agent's
  messages carry theirs as ``models_usage``.
- Pydantic AI: each ``ModelResponse`` has its request's ``usage`` (a ``RequestUsage``: ``input_tokens`` with the
  cached ones inside, for every provider, ``cache_read_tokens``, ``cache_write_tokens``, ``output_tokens``,
  ``details``, ``cost`` in USD or None), ``model_name``, ``provider_name`` and ``provider_response_id``.
"""

from __future__ import annotations

from typing import Any

#: (usage, keyword arguments for record_usage) for one report.
Report = tuple[Any, dict[str, Any]]


def _num(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def openai_agents_reports(obj: Any) -> list[Report]:
    """The reports of a ``RunResult`` (one per model response), a ``ModelResponse`` or a ``Usage``."""
    responses = getattr(obj, "raw_responses", None)
    if responses is None:
        responses = [obj] if hasattr(obj, "response_id") and hasattr(obj, "usage") else None
    if responses is None:
        return [(_agents_usage(obj), {"input_includes_cache": True})]
    agent = getattr(obj, "last_agent", None)
    model = getattr(agent, "model", None)
    out = []
    for r in responses:
        out.append((_agents_usage(r.usage), {"id": getattr(r, "response_id", None), "input_includes_cache": True,
                                             "model": model if isinstance(model, str) else None}))
    return out


def _agents_usage(u: Any) -> dict[str, Any]:
    if not hasattr(u, "input_tokens"):
        raise TypeError(f"expected an openai-agents RunResult, ModelResponse or Usage, got {type(u).__name__}")
    return {"input_tokens": u.input_tokens, "output_tokens": u.output_tokens,
            "cache_read_tokens": _num(getattr(u, "input_tokens_details", None), "cached_tokens"),
            "cache_write_tokens": _num(getattr(u, "input_tokens_details", None), "cache_write_tokens"),
            "reasoning_tokens": _num(getattr(u, "output_tokens_details", None), "reasoning_tokens")}


def agent_framework_report(response: Any) -> Report | None:
    """The report of an ``AgentResponse``/``ChatResponse`` (None: it carries no usage)."""
    usage = getattr(response, "usage_details", None)
    if not usage or all(v is None for v in dict(usage).values()):
        return None
    raw = getattr(response, "raw_representation", None)
    model = next((m for m in (getattr(o, a, None) for o in (response, raw) for a in ("model", "model_id"))
                  if isinstance(m, str) and m), None)
    return dict(usage), {"id": getattr(response, "response_id", None), "model": model}


def autogen_reports(obj: Any) -> list[Report]:
    """The reports of a ``CreateResult``, a ``RequestUsage``, or a ``Response``/``TaskResult`` (the
    ``models_usage`` of its messages)."""
    if hasattr(obj, "prompt_tokens"):
        return [(obj, {})]
    if hasattr(obj, "usage") and hasattr(getattr(obj, "usage"), "prompt_tokens"):
        return [(obj.usage, {})]
    messages = getattr(obj, "messages", None)
    if messages is None and hasattr(obj, "chat_message"):
        messages = [*(getattr(obj, "inner_messages", None) or []), obj.chat_message]
    if messages is None:
        raise TypeError(f"expected an AutoGen CreateResult, RequestUsage, Response or TaskResult, got "
                        f"{type(obj).__name__}")
    return [(m.models_usage, {}) for m in messages if getattr(m, "models_usage", None) is not None]


def pydantic_ai_report(response: Any) -> Report | None:
    """The report of a Pydantic AI ``ModelResponse`` (None: it reports no tokens, as a response built by hand)."""
    u = getattr(response, "usage", None)
    if u is None or not (getattr(u, "input_tokens", 0) or getattr(u, "output_tokens", 0)):
        return None
    details = getattr(u, "details", None) or {}
    cost = getattr(u, "cost", None)
    usage = {"input_tokens": u.input_tokens, "output_tokens": u.output_tokens,
             "cache_read_tokens": getattr(u, "cache_read_tokens", None),
             "cache_write_tokens": getattr(u, "cache_write_tokens", None),
             "reasoning_tokens": getattr(u, "output_reasoning_tokens", None)
             or (details.get("reasoning_tokens") if isinstance(details, dict) else None),
             "cost_usd": cost}
    name = getattr(response, "model_name", None)
    provider = getattr(response, "provider_name", None)
    rid = getattr(response, "provider_response_id", None)
    return usage, {"model": name if isinstance(name, str) and name else None,
                   "provider": provider if isinstance(provider, str) and provider else None,
                   "id": rid if isinstance(rid, str) and rid else None, "input_includes_cache": True}
