"""Content-only calibration probe (CPU): does the DP's layer similarity rank SmolLM2's anchor sets once the keys
that every selection forces in are left out?

Session 14 measured 8 anchor sets on SmolLM2's 4K dev split (260 prompts each). The calibration's similarity ranks
them against their accuracy (Spearman about -0.5 with the shipped statistics and with a decode-style k 410 / tail
one): the sets with anchors 1 and 3 look most similar and lose most. Hypothesis: the similarity is dominated by
mass that every recipe keeps anyway, the attention sinks, the keys just before the query and the diagonal tile,
so it cannot see whether an anchor finds the content keys (the needle) a later layer reads. This runs
`experiments.calibrate` with `stats.layer_similarity_row` replaced by a version that drops the first SINKS keys,
the RECENT keys before each query tile and the diagonal tile from both the selection and the mass, then scores
the measured sets against the result (`--score`).

    python results/accuracy/content_sim_probe.py --model=smollm2-135m --dataset=builtin_answers --calib_k=410 \
        --calib_reduce=tail --output_dir=/tmp/calib_content --nostability --noplots
    python results/accuracy/content_sim_probe.py --score /tmp/calib_content/*.npz [more .npz ...]
"""

from __future__ import annotations

import sys

SINKS, RECENT = 4, 60  # the dps recipe's forced keys (sink_tokens, recent_window)

# SmolLM2-135M, 4K dev (260 prompts), dense prefill + Kascade decode, calibrated head maps unless noted:
# results/accuracy/h200_2026-12-04_i21s14 (report/summary.md). Dense: 34.5.
MEASURED = {(0, 1, 3, 14, 24): 19.2, (0, 1, 3, 12, 17, 20, 23, 24): 23.9, (0, 1, 2, 3, 12, 17, 20, 21, 23, 24): 23.7,
            (0, 2, 8, 18): 28.5, (0, 2, 5, 8, 13, 18, 23): 29.5, (0, 1, 2, 3, 8, 9, 18, 19): 22.3,
            (0, 2, 6, 12, 18): 24.1, (0, 1, 2, 3, 14, 20, 21, 24): 21.6}


def content_only(layer_similarity_row):
    import jax.numpy as jnp

    def row(scores, diag, prev_idx, kv_len, tile_size, num_selected, reduce):
        n_tiles, n_keys = scores.shape[2], scores.shape[3]
        keys = jnp.arange(n_keys)[None, :]
        start = (jnp.arange(n_tiles) * tile_size)[:, None]
        forced = (keys < SINKS) | (keys >= start - RECENT)  # [tiles, keys]
        return layer_similarity_row(jnp.where(forced[None, None], -jnp.inf, scores), jnp.zeros_like(diag), prev_idx,
                                    kv_len, tile_size, num_selected, reduce)

    return row


def score(paths) -> None:
    import numpy as np
    from scipy.stats import spearmanr

    from kascade_jax.calibration.dp import objective, select_anchors
    from kascade_jax.calibration.head_map import anchor_of_layers

    for path in paths:
        z = np.load(path)
        sim, S = z["sim"], z["S"]
        L = sim.shape[0]
        U = np.triu(np.mean(np.max(sim, axis=-1), axis=-1))  # head-mapped similarity, unweighted
        acc, unw, wtd = [], [], []
        print(f"== {path}")
        for a, sc in MEASURED.items():
            of = anchor_of_layers(a, L)
            u = float(np.mean([U[of[b], b] for b in range(L) if b not in a]))
            acc.append(sc), unw.append(u), wtd.append(objective(S, a))
            print(f"  {','.join(map(str, a)):28s} dev {sc:5.1f}  unweighted {u:.3f}  DP objective {wtd[-1]:.3f}")
        print(f"  Spearman(dev, unweighted) {spearmanr(acc, unw)[0]:+.2f}, (dev, DP objective) "
              f"{spearmanr(acc, wtd)[0]:+.2f}")
        for m in (4, 5, 6):
            print(f"  DP M={m}: weighted {select_anchors(S)[m][0]}, unweighted {select_anchors(U)[m][0]}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--score":
        score(sys.argv[2:])
        sys.exit(0)
    from kascade_jax.calibration import stats

    stats.layer_similarity_row = content_only(stats.layer_similarity_row)
    from experiments import calibrate, cli

    cli.run(calibrate.main)
