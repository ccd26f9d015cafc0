"""KV-policy output for solve/chat: live recompute events (``-v``) and the final policy line."""

from __future__ import annotations

import sys

from rich.markup import escape

from zoomr.backends.base import KVStats
from zoomr.kvstore.events import EventBus, RecomputeEvent

from zoomr.cli.render import count, mib


def attach_live_events(bus: EventBus[RecomputeEvent] | None, out) -> bool:
    """Print every recompute event as its own line on stderr while tokens stream (``solve -v``).

    Returns True when a display was attached (False: the backend has no event bus).
    """
    if bus is None:
        return False

    def show(ev: RecomputeEvent) -> None:
        # the token stream is mid-line on the same terminal (or on stderr too, with --json -): the event
        # starts a line of its own
        if out.live:
            out.err.print(f"\n[dim cyan]⟲ {escape(ev.describe())}[/dim cyan]")
        else:
            print(f"\n⟲ {ev.describe()}", file=sys.stderr, flush=True)

    bus.subscribe(show)
    return True


def policy_line(kv: KVStats) -> str | None:
    """One line of policy statistics from ``kv.extra`` (None for the plain full cache).

    Shows the policy, which summaries mode ran, recomputes, AG mean ± std, active tokens (mean, peak),
    full tokens, bytes of both and the memory saving (time-averaged, and at the peak), and for ZoomR the
    saving ZoomR §3.5's formula predicts from the run's own lengths; for ZoomR on llama.cpp, that its store
    keeps every position.
    """
    x = kv.extra
    if "policy" not in x:
        return None
    parts = [f"KV policy {x['policy']}"]
    if "summaries_mode" in x:
        ran = x["summaries_mode"]
        parts.append(f"summaries: {ran} (--summaries {x['summaries_option']})")
        cut = f" ({x['summaries_written']} summarized, {x['segments_cut_auto']} cut as auto)" \
            if x.get("segments_cut_auto") and x.get("summaries_written") is not None else ""
        parts.append(f"{count(x['segments'], 'segment')}{cut} · {count(x['recomputes'], 'recompute')}")
    if x.get("ag_mean") is not None:
        parts.append(f"AG {x['ag_mean']:.3f} ± {x['ag_std']:.3f}")
    parts.append(f"active mean {kv.mean_active_tokens:.0f} / peak {kv.peak_active_tokens} tok "
                 f"of {kv.full_tokens} ({mib(kv.active_bytes)} / {mib(kv.full_bytes)}) · saving {kv.saving:.2f}× "
                 f"(mean full / (mean active + policy state) bytes, state ≤ {mib(kv.policy_state_bytes)}; "
                 f"{kv.saving_peak:.2f}× at the peak)")
    if x.get("saving_formula") is not None:
        f = x["formula_inputs"]
        parts.append(f"§3.5 formula {x['saving_formula']:.2f}× (N_p {f['n_prompt']}, N_g {f['n_generated']}, "
                     f"L̄_R {f['mean_regular']:.0f}, L̄_S {f['mean_summary']:.0f}, |I_all| {f['n_voted']}, "
                     f"N_w {f['window']})")
    if "llama_store_cells" in x:   # zoomr on llama.cpp: say where the memory went
        parts.append(f"{x.get('restored_tokens', 0)} tok zoomed back in · llama.cpp keeps all "
                     f"{x['llama_store_cells']} positions (store sequence): the selection saves attention, not KV memory")
    return " · ".join(parts)
