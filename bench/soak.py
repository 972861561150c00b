"""The long mixed run of #16 at full length: 30 prompts through one started ComfyUI server, each compared with the
same prompt alone in a fresh server and timed against a server without Compile Model (bench/README.md); writes
docs/benchmarks/soak.md (or --out).

    python bench/soak.py [--out docs/benchmarks/soak.md] [--seed 0]
"""
from __future__ import annotations

import platform
import random
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401  (the project root on sys.path)
from tools.comfy_env import ROOT
from tools.harness import cli

PROMPTS = 30


def timed_latent(server, prompt, prefix: str):
    """Run `prompt`; its latent, and the seconds ComfyUI took to execute it (from its own execution_start and
    execution_success timestamps: polling /history would round to its 0.25 s period)."""
    from tools.soak_prompts import graph_of, saved_latent

    entry = server.run_workflow(graph_of(prompt, prefix), timeout=900)
    stamps = {name: data["timestamp"] for name, data in entry["status"]["messages"]}
    return saved_latent(server, prefix), (stamps["execution_success"] - stamps["execution_start"]) / 1000


def compiles_in_prompts(server) -> int:
    """How many compiles (or loads) so far made a prompt wait: the pack counts each ("compiling_now" events)."""
    return server.get_json("/accel/stats")["counters"].get("compile_model.compiling_now", 0)


def main() -> None:
    parser = cli.parser(__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks" / "soak.md")
    parser.add_argument("--seed", type=int, default=0, help="the order of the prompts")
    args = parser.parse_args()

    import torch
    from tools.harness.machine import cpu_model
    from tools.soak_prompts import CONFIGS, EAGER, cold_compiles, rss_mb, server_of
    from tools.comfy_env import comfyui_version

    order, rng = [], random.Random(args.seed)
    while len(order) < PROMPTS:  # passes of every configuration, shuffled, the plain prompt right after the swap
        indices = [0, 1, 2, 3]
        rng.shuffle(indices)
        swap = indices.index(3)
        order += indices[:swap + 1] + [4] + indices[swap + 1:]
    order = order[:PROMPTS]
    # The first pass (each configuration once, the plain prompt after the swap) is the server's warm-up: after each
    # of its prompts the run waits for the background compile, so that the compiled graphs are loaded by the fifth
    # prompt and the RSS bound (last prompt against the fifth) measures growth, not the one-time cost of loading them.
    warm_up = len(CONFIGS)

    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        references = {}
        for i, prompt in enumerate(CONFIGS):
            with server_of(tmp / f"fresh-{i}", EAGER, api_nodes=True) as fresh:
                references[prompt], _ = timed_latent(fresh, prompt, f"fresh-{i}")
        # The same order in a server where Compile Model is off (ACCEL_DISABLE_COMPILE=1; DeepCache and Swap Weights
        # act as in the mixed run): each prompt's time there, with the same model switches before it.
        eager_seconds = []
        with server_of(tmp / "eager-mixed", EAGER, api_nodes=True) as eager:
            for n, index in enumerate(order):
                eager_seconds.append(timed_latent(eager, CONFIGS[index], f"eager-{n}")[1])
        rows = []
        with server_of(tmp / "mixed", api_nodes=True) as mixed:
            for n, index in enumerate(order):
                prompt = CONFIGS[index]
                waited_before = compiles_in_prompts(mixed)
                out, seconds = timed_latent(mixed, prompt, f"mixed-{n}")
                in_prompt = compiles_in_prompts(mixed) - waited_before
                if n < warm_up:  # as a worker warms up: each compile done before the next prompt comes
                    mixed.wait_for_background()
                if n == warm_up - 1:
                    cold_before = sum(cold_compiles(mixed).values())
                reference = references[prompt]
                diff = (out - reference).abs().max().item() / max(reference.abs().max().item(), 1.0)
                rows.append((n + 1, prompt, seconds, diff, torch.equal(out, reference), rss_mb(mixed),
                             seconds / eager_seconds[n], in_prompt))
            cold_after = sum(cold_compiles(mixed).values())

    lines = [
        "# Soak: 30 mixed prompts on one server against each prompt alone in a fresh server",
        "",
        f"Measured {time.strftime('%Y-%m-%d')} by `python bench/soak.py --seed {args.seed}`: "
        f"{cpu_model()}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"ComfyUI {comfyui_version()}, on the CPU (no GPU). "
        f"The whole run took {time.time() - started:.0f} s.",
        "",
        "| # | configuration | seconds | eager server's | ratio | compiles in the prompt | max rel diff vs fresh "
        "| bit-equal | RSS MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *[f"| {n} | {p.name} | {s:.2f} | {eager_seconds[n - 1]:.2f} | {ratio:.2f}x | {waits} | {d:.2e} | "
          f"{'yes' if eq else 'no'} | {rss:.0f} |" for n, p, s, d, eq, rss, ratio, waits in rows],
        "",
        f"- Prompts over 1.3x the same prompt's time in the server without Compile Model (same order): "
        f"{sum(r[6] > 1.3 for r in rows)} of {len(rows)} "
        f"({', '.join(f'#{r[0]} {r[6]:.2f}x' for r in rows if r[6] > 1.3) or 'none'}); the largest ratio after the "
        f"warm-up pass: {max(r[6] for r in rows[warm_up:]):.2f}x.",
        f"- Compiles a prompt waited for (in its path) after the warm-up pass: {sum(r[7] for r in rows[warm_up:])}; "
        f"in the warm-up pass: {sum(r[7] for r in rows[:warm_up])}.",
        f"- Cold compiles (FX graph cache misses) after the first pass: {cold_after - cold_before}.",
        f"- RSS after the last prompt / after the fifth, the end of the warm-up pass (each configuration once, "
        f"each background compile waited for): {rows[-1][5] / rows[warm_up - 1][5]:.3f} (bound: 1.05). The "
        f"largest RSS of prompts {warm_up + 1} to {PROMPTS} / after the fifth: "
        f"{max(r[5] for r in rows[warm_up:]) / rows[warm_up - 1][5]:.3f}.",
        "- Without Compile Model every output must be bit-equal; with it, within the compiled tolerance "
        "(rtol 1e-3, atol 2e-5 of the largest value).",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
