"""The scheduler's side of scheduler.proto: an AddRequest reaches `Request` with every field."""

from __future__ import annotations

from services.scheduler import wire
from services.scheduler.request import Request
from shared.sampling import SamplingOptions
from shared.types import RequestKind


def test_add_request_fields_survive_the_wire() -> None:
    sent = Request("e1", [5, 6, 7], SamplingOptions(max_tokens=1), kind=RequestKind.EMBED, priority=3,
                   traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", deadline_unix_s=12.5,
                   cache_salts=("img",), token_type_ids=[0, 0, 1], normalize=True, output_token_ids=[9],
                   frontend_id="fe-1", shares_prompt_with="e0")
    sent.is_resumed = True
    [msg] = wire.add_requests_to_proto([sent]).add.requests
    got = wire.request_from_proto(msg, connection_id=4)
    assert got.to_dict() == sent.to_dict() | {"connection_id": 4}
    assert (got.normalize, got.is_resumed, got.shares_prompt_with) == (True, True, "e0")
    plain = wire.request_from_proto(wire.add_requests_to_proto([Request("g", [5])]).add.requests[0], 0)
    assert plain.normalize is False
