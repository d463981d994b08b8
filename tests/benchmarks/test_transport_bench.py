"""The transport benchmark (benchmarks/transport_bench.py): real pairs of processes on loopback."""

from __future__ import annotations

import pytest

from benchmarks.transport_bench import TRANSPORTS, Cell, SideCpu, format_table, main, measure


@pytest.mark.parametrize("pace_ms", [0.0, 0.2])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_transport_delivers_every_message_and_charges_both_sides(transport: str, pace_ms: float) -> None:
    # Paced, the receiver cancels the call while the sender still waits out its pace: both
    # sides must report rather than hang.
    cell = measure(transport, pace_ms=pace_ms, messages=120, rows=4)
    assert (cell.transport, cell.pace_ms) == (transport, pace_ms)
    # Every message costs each side something: a side that saw none would report zero (or fail).
    assert cell.sender.total_us > 0 and cell.receiver.total_us > 0
    assert cell.sender.user_us >= 0 and cell.receiver.sys_us >= 0


def test_the_table_has_one_row_per_cell_with_both_sides_summed() -> None:
    cells = [Cell("grpc", 0.7, SideCpu(60, 50), SideCpu(40, 30)), Cell("stream", 0.0, SideCpu(3, 4), SideCpu(5, 2))]
    table = format_table(cells, rows=1).splitlines()
    assert table[3] == "| grpc | 0.7 | 60 + 50 | 40 + 30 | 180 |"
    assert table[4] == "| stream | 0 | 3 + 4 | 5 + 2 | 14 |"


def test_the_command_line_refuses_too_few_messages_and_unknown_transports(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--messages", "10"])
    assert "warm-up" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--transports", "grpc,pigeon", "--messages", "100"])
    assert "pigeon" in capsys.readouterr().err
