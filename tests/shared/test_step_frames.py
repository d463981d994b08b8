"""Frames of the step socket: what a reader makes of whole, cut and oversized frames."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shared.pb.spindle.v1 import common_pb2, worker_pb2
from shared.step_frames import END, HEADER, MAX_FRAME_BYTES, STEP, FrameError, end_frame, frame, parse_end, read_frame


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_frames_read_back_in_order_then_none_at_a_clean_end() -> None:
    step = worker_pb2.ExecuteResponse(round_id=3, token_ids=[5, 6]).SerializeToString()
    reader = reader_of(frame(STEP, step) + frame(STEP, b"") + end_frame(grpc.StatusCode.OK))
    assert await read_frame(reader) == (STEP, step)
    assert await read_frame(reader) == (STEP, b"")
    kind, payload = await read_frame(reader)
    assert (kind, parse_end(payload)) == (END, (grpc.StatusCode.OK, ""))
    assert await read_frame(reader) is None


@pytest.mark.parametrize(("data", "error"), [
    (frame(STEP, b"abc")[:3], "inside a frame header"),
    (frame(STEP, b"abcdef")[:-2], "inside a frame of 6 bytes"),
    (HEADER.pack(MAX_FRAME_BYTES + 1, STEP), "over the limit"),
])
async def test_a_cut_or_oversized_frame_is_an_error(data: bytes, error: str) -> None:
    with pytest.raises(FrameError, match=error):
        await read_frame(reader_of(data))


def test_an_end_frame_carries_the_status_and_an_unknown_code_reads_as_unknown() -> None:
    payload = end_frame(grpc.StatusCode.UNAVAILABLE, "busy")[HEADER.size:]
    assert parse_end(payload) == (grpc.StatusCode.UNAVAILABLE, "busy")
    odd = common_pb2.StreamEnd(code=99, message="?").SerializeToString()
    assert parse_end(odd) == (grpc.StatusCode.UNKNOWN, "?")
