"""POST /v1/cache/pin, DELETE /v1/cache/pin/{id}, GET /v1/cache/pins (kv/pins.py).

A pin is made in two moves on the engine's thread: the prompt's blocks are pinned if the device
holds them all; if not, the prompt is run first (a prefill, no token sampled) and pinned right
after. Between the two an eviction could take a block again (the engine steps other requests in
between), so the pair is tried a few times before the server answers 503. Room is checked
before any prefill is spent: a pin past the caller's --max-pinned-fraction (each tenant's own
budget) or past --max-pinned-total-fraction (all tenants') is a 400 `pin_limit` naming the
caller's own count and budget only (kv/pins.py).

A pin belongs to the caller who made it (server/auth.py): a caller lists and releases its own
pins (with its own count and budget, never another tenant's), and another caller's pin id
answers 404 as an unknown one would; the admin sees them all, and the server-wide count.
The pin is made in the caller's cache namespace, as its requests are.
"""

from __future__ import annotations

from typing import Any

from kvserve.kv.pins import PinLimitError
from kvserve.sampling import SamplingParams
from kvserve.server.auth import Caller
from kvserve.server.protocol import APIError, CachePinRequest

PIN_ATTEMPTS = 3


def _owner(caller: Caller) -> str:
    return caller.key or ""


async def create_pin(serving: Any, req: CachePinRequest, caller: Caller) -> dict[str, Any]:
    serving.check_model(req.model)
    if not serving.engine.config.enable_prefix_caching:
        raise APIError(400, "pinning needs prefix caching (the server runs with "
                       "--no-enable-prefix-caching)")
    prompt = {"prompt_token_ids": (await serving.cache_prompt(req))["prompt_token_ids"]}
    salt = serving.access.namespace(caller, req.cache_salt)
    try:
        await serving.engine.pin_room(prompt, salt, _owner(caller))
    except PinLimitError as exc:
        raise APIError(400, str(exc), param="prompt", code="pin_limit") from exc
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), param="prompt") from exc
    for _ in range(PIN_ATTEMPTS):
        try:
            pin = await serving.engine.pin_prefix(prompt, salt, _owner(caller))
        except PinLimitError as exc:  # another pin took the room meanwhile
            raise APIError(400, str(exc), param="prompt", code="pin_limit") from exc
        if pin is not None:
            return pin
        async for _out in serving.engine.generate(prompt, SamplingParams(max_tokens=1),
                                                  stream=False, cache_salt=salt):
            pass
    raise APIError(503, "the prompt's blocks were evicted before they could be pinned "
                   f"({PIN_ATTEMPTS} tries); the pool is under pressure, retry later")


async def delete_pin(serving: Any, pin_id: str, caller: Caller) -> dict[str, Any]:
    owner = None if caller.admin else _owner(caller)
    pin = await serving.engine.unpin(pin_id, owner)
    if pin is None:
        raise APIError(404, f"no pin {pin_id!r}", param="pin_id")
    return {**pin, "deleted": True}


async def list_pins(serving: Any, caller: Caller) -> dict[str, Any]:
    owner = None if caller.admin else _owner(caller)
    return await serving.engine.list_pins(owner)
