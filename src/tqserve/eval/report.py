"""Tables on stdout and PNG figures (matplotlib, headless) for the evaluations."""

from __future__ import annotations

import json
import os


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """columns: (key, header, format spec) -> a Markdown table."""
    head = "| " + " | ".join(h for _, h, _ in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    lines = [head, sep]
    for r in rows:
        cells = []
        for key, _, fmt in columns:
            v = r.get(key, "")
            spec = fmt
            if spec.endswith("d") and isinstance(v, float):
                # Integer columns may hold averages (per-layer presets: mean page bytes over layers).
                v, spec = (int(v), spec) if v.is_integer() else (v, ".2f")
            cells.append(format(v, spec) if spec and isinstance(v, (int, float)) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(out_dir: str, name: str, data) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_distortion(rows: list[dict], path: str) -> None:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, d in zip(axes, sorted({r["d"] for r in rows})):
        for mode, marker in (("plain", "o"), ("nc", "s"), ("unbiased", "^")):
            rs = [r for r in rows if r["d"] == d and r["scale_mode"] == mode]
            ax.semilogy([r["bits"] for r in rs], [r["mse"] for r in rs], marker, label=f"measured ({mode})", alpha=0.7)
        rs = [r for r in rows if r["d"] == d and r["scale_mode"] == "plain"]
        bits = [r["bits"] for r in rs]
        ax.semilogy(bits, [r["mse_theory_table"] for r in rs], "k-", label="Lloyd-Max N(0,1) table")
        ax.semilogy(bits, [r["mse_theory_d"] for r in rs], "k--", label=f"theory at d={d}")
        ax.semilogy(bits, [4.0**-b for b in bits], "k:", label="lower bound 4^-b")
        ax.set_title(f"TurboQuant MSE on random unit vectors, d={d}")
        ax.set_xlabel("bits per coordinate")
        ax.set_ylabel("E||u - u_hat||^2")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ppl(rows: list[dict], path: str) -> None:
    """Quality vs size: bits per value (all overheads at 4K) against ppl change and mean KL."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in (
        (axes[0], "ppl_delta_pct", "perplexity vs exact (%)"),
        (axes[1], "kl_mean", "mean KL vs exact"),
    ):
        for r in rows:
            if r["preset"] == "auto":
                continue
            color = (
                "tab:red"
                if r["preset"].startswith("turboquant")
                else ("tab:blue" if r["preset"].startswith("tq") else "tab:gray")
            )
            ax.scatter(r["bits"], max(r[key], 1e-5) if key == "kl_mean" else r[key], color=color)
            ax.annotate(r["preset"], (r["bits"], max(r[key], 1e-5) if key == "kl_mean" else r[key]), fontsize=7)
        if key == "kl_mean":
            ax.set_yscale("log")
        ax.set_xlabel("bits per value (K+V, exact sink/window counted at 4K context)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_title("red: vLLM presets, blue: tqserve, gray: others")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_needle(result: dict, path: str) -> None:
    plt = _plt()
    presets = list(result["summary"])
    lengths, depths = result["lengths"], result["depths"]
    fig, axes = plt.subplots(1, len(presets), figsize=(3.2 * len(presets), 3.4), squeeze=False)
    for ax, p in zip(axes[0], presets):
        grid = [[0.0] * len(lengths) for _ in depths]
        found = [[False] * len(lengths) for _ in depths]
        for c in result["cells"]:
            i, j = depths.index(c["depth"]), lengths.index(c["length"])
            grid[i][j] = c["results"][p]["loglik"]
            found[i][j] = c["results"][p]["found"]
        im = ax.imshow(grid, cmap="viridis", vmin=-3, vmax=0, aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                ax.text(
                    j,
                    i,
                    ("Y" if found[i][j] else "n") + f"\n{grid[i][j]:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="w",
                )
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
        ax.set_title(p, fontsize=8)
        ax.set_xlabel("context length")
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="answer log-likelihood")
    fig.savefig(path, dpi=120)
    plt.close(fig)
