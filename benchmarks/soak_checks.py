"""The soak's verdicts: after the load stops and the server settles, is everything back to baseline?

Pure functions over snapshots and the tally, so each rule is tested without a server:
- KV: no block in use (blocks only the prefix cache holds count as free);
- requests: none running or waiting in the scheduler, none in flight in the frontend;
- outcomes: no ERROR (every valid request the client kept finished normally, every invalid
  one got 400 / INVALID_ARGUMENT), and at least one request of each kind was really sent;
- processes: the same pids as at the baseline (the launcher restarts a dead child silently,
  so a crash would otherwise go unnoticed);
- memory: each process's RSS within the larger of +`pct` % and +`mib` MiB of its baseline;
- the server's log: no error record and no traceback while the soak ran (a client that goes
  away is routine; logging it as an error buries real ones), except messages an `allowed`
  pattern matches.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.soak_outcome import ABORTED, COMPLETED, ERROR, REJECTED, Tally
from benchmarks.soak_probe import Snapshot

MIB = 2**20


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"[{'PASS' if self.ok else 'FAIL'}] {self.name}: {self.detail}"


def rss_limit(baseline: int, pct: float, mib: float) -> int:
    """The most RSS a process may have at the end: baseline plus the larger of the two allowances."""
    return int(max(baseline * (1 + pct / 100), baseline + mib * MIB))


def check_idle(final: Snapshot) -> list[Check]:
    return [
        Check("kv blocks", final.kv_used_blocks == 0,
              f"{final.kv_used_blocks} of {final.kv_blocks} in use (prefix-cache-only blocks count as free)"),
        Check("open requests", (final.running, final.waiting, final.frontend_in_flight) == (0, 0, 0),
              f"scheduler running {final.running}, waiting {final.waiting}; frontend in flight "
              f"{final.frontend_in_flight}"),
    ]


def check_outcomes(tally: Tally, expect_aborts: bool = True, expect_invalid: bool = True) -> list[Check]:
    errors = tally.kinds[ERROR]
    reasons = "; ".join(f"{n} x {reason}" for reason, n in tally.error_reasons.most_common(5))
    checks = [Check("errors", errors == 0, f"{errors} of {tally.total} requests" + (f" ({reasons})" if errors else "")),
              Check("requests sent", tally.kinds[COMPLETED] > 0,
                    f"{tally.kinds[COMPLETED]} completed, {tally.kinds[ABORTED]} aborted, "
                    f"{tally.kinds[REJECTED]} invalid ones rejected")]
    if expect_aborts:
        checks.append(Check("aborts exercised", tally.kinds[ABORTED] > 0, f"{tally.kinds[ABORTED]} aborted"))
    if expect_invalid:
        checks.append(Check("invalid requests exercised", tally.kinds[REJECTED] > 0,
                            f"{tally.kinds[REJECTED]} rejected"))
    return checks


def check_processes(baseline: Snapshot, final: Snapshot) -> Check:
    changed = sorted(name for name in baseline.pids.keys() | final.pids.keys()
                     if baseline.pids.get(name) != final.pids.get(name))
    return Check("processes", not changed,
                 "no service restarted" if not changed else f"restarted or gone: {', '.join(changed)}")


def check_rss(baseline: Snapshot, final: Snapshot, pct: float, mib: float) -> list[Check]:
    checks = []
    for name, before in sorted(baseline.rss.items()):
        after = final.rss.get(name, 0)
        limit = rss_limit(before, pct, mib)
        growth = (after - before) / before * 100 if before else 0.0
        checks.append(Check(f"rss {name}", 0 < after <= limit,
                            f"{before / MIB:.0f} -> {after / MIB:.0f} MiB ({growth:+.1f} %, limit {limit / MIB:.0f})"))
    return checks


# A record at error level in either log format of shared/logs.py, or a bare traceback on stderr.
_ERROR_RECORD = re.compile(r'level=(error|critical)|"level": ?"(error|critical)"|^Traceback ', re.IGNORECASE)
_MESSAGE = re.compile(r'msg="((?:[^"\\]|\\.)*)"|"msg": ?"((?:[^"\\]|\\.)*)"')
_LAST_EXCEPTION = re.compile(r"^\s*(\w+(?:\.\w+)*(?:Error|Exception|Exit)\b[^\\\"\n]*)", re.MULTILINE)


def log_errors(lines: Sequence[str]) -> Counter[str]:
    """Error records in `lines`, counted by message (and the exception's last line when one is logged)."""
    found: Counter[str] = Counter()
    for line in lines:
        if not _ERROR_RECORD.search(line):
            continue
        message = _MESSAGE.search(line)
        text = next((g for g in message.groups() if g), "") if message else line.strip()
        exceptions = _LAST_EXCEPTION.findall(line.replace("\\n", "\n"))  # a logged traceback's lines
        found[f"{text[:100]}{f' ({exceptions[-1][:100]})' if exceptions else ''}"] += 1
    return found


def check_log(lines: Sequence[str], allowed: Sequence[str] = ()) -> Check:
    errors = log_errors(lines)
    kept = Counter({m: n for m, n in errors.items() if not any(re.search(a, m) for a in allowed)})
    shown = "; ".join(f"{n} x {m}" for m, n in kept.most_common(3))
    ignored = sum(errors.values()) - sum(kept.values())
    detail = f"{sum(kept.values())} error records: {shown}" if kept else "no error record"
    return Check("server log", not kept, detail + (f" ({ignored} allowed ones ignored)" if ignored else ""))


def all_checks(tally: Tally, baseline: Snapshot, final: Snapshot, pct: float, mib: float, log_lines: Sequence[str],
               allowed_log: Sequence[str] = (), expect_aborts: bool = True, expect_invalid: bool = True) -> list[Check]:
    return [*check_idle(final), *check_outcomes(tally, expect_aborts, expect_invalid),
            check_processes(baseline, final), *check_rss(baseline, final, pct, mib),
            check_log(log_lines, allowed_log)]
