"""PNG plots of a calibration: heatmap of the layer scores S and bar chart of the importance weights w.

Deliberately minimal (matplotlib, Agg backend, no styling beyond labels); nothing here is used at run time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def save_plots(artifact, stem) -> list[Path]:
    """Write `<stem>_S.png` and `<stem>_w.png`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    L = artifact.num_layers
    upper = np.triu(np.ones((L, L), bool))
    sim = np.where(upper, artifact.sim.max(-1).mean(-1), np.nan)  # unweighted mean_h max_g sim
    S = np.where(upper, artifact.S, np.nan)
    m = 5 if 5 in artifact.anchors else max(artifact.anchors)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.5))
    for ax, mat, label in ((axes[0], sim, "mean_h max_g sim[a, b, h, g]"), (axes[1], S, "S[a][b] = w_b * mean_h max_g sim")):
        im = ax.imshow(mat, cmap="viridis", origin="upper")
        fig.colorbar(im, ax=ax, label=label, shrink=0.85)
        ax.set_xlabel("reuse layer b")
        ax.set_ylabel("anchor layer a")
    axes[0].set_title("head similarity after remapping (unweighted)", fontsize=9)
    axes[1].set_title("importance-weighted (the DP's input)", fontsize=9)
    fig.suptitle(f"{artifact.model_name}: {artifact.dataset}, n={artifact.num_prompts}, k={artifact.k}, "
                 f"tile {artifact.tile_size}, reduce={artifact.reduce}; anchors M={m}: {list(artifact.anchors[m])}",
                 fontsize=10)
    paths = [stem.with_name(stem.name + "_S.png")]
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    ax.bar(np.arange(L), artifact.w, color="tab:blue")
    ax.set_xlabel("layer")
    ax.set_ylabel("w = 1 - cos(x, x + attn)")
    ax.set_title(f"{artifact.model_name}: layer importance", fontsize=9)
    paths.append(stem.with_name(stem.name + "_w.png"))
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths
