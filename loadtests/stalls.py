"""Silences of a run: intervals where requests were in flight and the server sent nothing at all.

A server that stops answering for a while (paused, swapping, a GC pause, a stuck step) does not fail requests;
it makes them slow, and a latency table alone cannot tell a stall from a slow server. From every request's own
timeline (send, each streamed piece, the end: `start`, `ttft_ms`, `itl_ms`, `e2e_ms`) this finds the silences
before each server event (a piece or an end, of any request): from the previous event, or from the first send
of a request still waiting then if that came later, to the event. A silence is a stall when it is far outside
the run's own: longer than `factor` x the run's reference silence and than `floor_s` (relative to the run
itself, never to one machine's speed). The reference is the p99 silence, or the (STANDOUT + 1)-th longest
where fewer than STANDOUT lie above the p99 (a run of at most 500 silences): in a short run the p99 is the
longest silence itself, which a stall then measured against itself (a 24 s chat run at 2 users, its server
paused for 7 s, had under 100 silences and reported no stall).
"""

from __future__ import annotations

from typing import Any

FACTOR = 5.0        # a stall is longer than FACTOR x the run's own p99 (or 6th longest) silence ...
FLOOR_S = 2.0       # ... and than this many seconds
STANDOUT = 5        # so many silences at least lie above the reference, however short the run


def timeline(sample: dict[str, Any]) -> tuple[float, float, list[float]] | None:
    """(sent, ended, server event times) of one request, in the samples' clock (seconds); None if unknown."""
    if sample.get("start") is None or sample.get("e2e_ms") is None:
        return None
    t0 = float(sample["start"])
    end = t0 + sample["e2e_ms"] / 1000
    events = []
    if sample.get("ttft_ms") is not None:
        t = t0 + sample["ttft_ms"] / 1000
        events.append(t)
        for gap in sample.get("itl_ms") or []:
            t += gap / 1000
            events.append(t)
    events.append(end)
    return t0, end, events


def silences(samples: list[dict[str, Any]], *, factor: float = FACTOR, floor_s: float = FLOOR_S) -> dict[str, Any]:
    """{"longest_s", "longest_at_s", "threshold_s", "stalls": [{"at_s", "s", "waiting"}]} of a run's samples
    (times relative to the run's first send); empty figures when fewer than two requests have timelines."""
    lines = [tl for tl in map(timeline, samples) if tl is not None]
    out: dict[str, Any] = {"longest_s": None, "longest_at_s": None, "threshold_s": None, "stalls": []}
    if len(lines) < 2:
        return out
    origin = min(t0 for t0, _, _ in lines)
    events = sorted(t for _, _, ev in lines for t in ev)
    by_start = sorted(lines, key=lambda tl: tl[0])
    gaps = []                       # (silence s, from, requests waiting through it)
    i, flight = 0, []               # (sent, ended) of the requests sent before event b and not ended before it
    for a, b in zip(events, events[1:]):
        while i < len(by_start) and by_start[i][0] < b:
            flight.append(by_start[i][:2])
            i += 1
        flight = [(t0, end) for t0, end in flight if end >= b]
        if not flight:
            continue
        start = max(a, min(t0 for t0, _ in flight))        # silent since the last event or the first send
        if b > start:
            gaps.append((b - start, start, len(flight)))
    if not gaps:
        return out
    ordered = sorted(g for g, _, _ in gaps)
    reference = ordered[max(0, min(int(0.99 * len(ordered)), len(ordered) - 1 - STANDOUT))]
    threshold = max(floor_s, factor * reference)
    longest = max(gaps)
    out.update(longest_s=round(longest[0], 3), longest_at_s=round(longest[1] - origin, 3),
               threshold_s=round(threshold, 3),
               stalls=[{"at_s": round(at - origin, 3), "s": round(g, 3), "waiting": w}
                       for g, at, w in gaps if g > threshold])
    return out


def describe(cell: dict[str, Any]) -> str | None:
    """One line for the report when a run stalled, else None."""
    stalls = (cell.get("silence") or {}).get("stalls") or []
    if not stalls:
        return None
    worst = max(stalls, key=lambda s: s["s"])
    return (f"{cell['profile']}/{cell['setting']}: the server sent nothing for {worst['s']:.1f} s at "
            f"t = {worst['at_s']:.1f} s with {worst['waiting']} request(s) waiting ({len(stalls)} stall(s) over "
            f"{(cell['silence']['threshold_s'] or 0):.1f} s); its latencies include the stall")
