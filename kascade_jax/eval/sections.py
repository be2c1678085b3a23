"""Markdown sections of an eval summary beyond the score table: the fidelity metrics and LongBench's category
averages (experiments.eval and experiments.merge_eval write them under the table)."""

from __future__ import annotations


def fidelity_section(fid: dict) -> str:
    def num(x, fmt):
        return "-" if x is None or x != x else format(x, fmt)  # x != x: NaN (every document failed)

    def mean_worst(ratio):
        if not ratio:
            return "-", "-"
        worst = min(range(len(ratio)), key=ratio.__getitem__)
        return f"{sum(ratio) / len(ratio):.3f}", f"L{worst}: {ratio[worst]:.3f}"

    def count(f, total, done):  # a cut block says how far it got
        return f[total] if "state" not in f else f"{f[done]} of {f[total]} (cut; --resume goes on)"

    errors, lines = [], []

    def note_errors(f, unit):
        if f.get("errors"):
            errors.append(f"- {f['strategy']} {f['config']}: {f['failures']} failed {unit}, first: {f['errors'][0]}")

    answers = {k: f for k, f in fid.items() if f.get("task") == "answers"}
    prose = [f for k, f in fid.items() if k not in answers]
    if prose:
        lines += ["## Fidelity vs dense (teacher forcing on prose)", "",
                  "| strategy | config | ctx | docs | fail | KL (nats/token) | top-1 agree % | KL 2nd half | "
                  "prefill mass / oracle (mean over layers) | worst layer | worst (layer, KV head) | "
                  "decode mass / oracle | worst decode layer |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in prose:
        mean, worst = mean_worst(f.get("mass_ratio"))
        dmean, dworst = mean_worst(f.get("decode_mass_ratio"))
        heads = f.get("mass_ratio_heads")
        if heads:
            cells = [(r, l, h) for l, row in enumerate(heads) for h, r in enumerate(row)]
            r, l, h = min(cells)
            worst_head = f"L{l} H{h}: {r:.3f}"
        else:
            worst_head = "-"
        top1 = f.get("top1")
        lines.append(f"| {f['strategy']} | {f['config']} | {f['context_length']} | "
                     f"{count(f, 'documents', 'documents_done')} | "
                     f"{f['failures']} | {num(f['kl'], '.4f')} | {num(None if top1 is None else 100 * top1, '.1f')} | "
                     f"{num(f['kl_late'], '.4f')} | {mean} | {worst} | {worst_head} | {dmean} | {dworst} |")
        note_errors(f, "documents")
    if answers:
        lines += ([""] if lines else []) + [
            "## Decode fidelity along dense's answers (RULER prompts, teacher-forced)", "",
            "| strategy | config | ctx | prompts | fail | steps | answer steps agreeing % | first token agreeing % | "
            "answers reproduced % | KL (nats/step) | decode mass / oracle | worst decode layer |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in answers.values():
        dmean, dworst = mean_worst(f.get("decode_mass_ratio"))
        lines.append(f"| {f['strategy']} | {f['config']} | {f['context_length']} | "
                     f"{count(f, 'prompts', 'prompts_done')} | {f['failures']} | "
                     f"{f['steps']} | {num(100 * f['agree'], '.2f')} | {num(100 * f['first_agree'], '.1f')} | "
                     f"{num(100 * f['reproduced'], '.1f')} | {num(f['kl'], '.4f')} | {dmean} | {dworst} |")
        note_errors(f, "prompts")
    if errors:
        lines += ["", *errors]
    return "\n".join(lines)


def longbench_section(rows) -> str:
    from kascade_jax.tasks import longbench  # noqa: PLC0415  (importing this module stays light)

    groups: dict = {}
    for r in rows:
        if r["family"] == "longbench":
            groups.setdefault((r["strategy"], r["config"]), {})[r["task"]] = r["score"]
    if not groups:
        return ""
    cats = list(longbench.CATEGORIES)
    lines = ["## LongBench category averages", "", "| strategy | config | " + " | ".join(cats) + " |",
             "|---|---|" + "---|" * len(cats)]
    for (strategy, config), scores in groups.items():
        avg = longbench.category_averages(scores)
        lines.append(f"| {strategy} | {config} | " + " | ".join(f"{avg[c]:.1f}" if c in avg else "-" for c in cats)
                     + " |")
    return "\n".join(lines)
