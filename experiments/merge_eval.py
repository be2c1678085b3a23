"""`python -m experiments.merge_eval --inputs=a,b,c --merged_dir=d`: one report from several eval runs.

Long evaluations run as several `experiments.eval` processes (e.g. in parallel on one GPU, one strategy group
each); this joins their results.json / examples.jsonl into one results.csv / results.json / examples.jsonl /
summary.md (with a strategy x context pivot table) and the plots. `--labels=b:kascade_even` renames the
strategy of every row that came from input b (e.g. the evenly spaced anchors ablation), so it gets its own line.
"""

from __future__ import annotations

import os

from absl import flags

from experiments import cli

FLAGS = flags.FLAGS
flags.DEFINE_list("inputs", [], "eval output directories (each holding results.json)")
flags.DEFINE_list("labels", [], "input:strategy_label pairs that rename the strategy of that input's rows")
flags.DEFINE_string("merged_dir", "runs/merged", "where the merged report goes (a folder that holds anything needs "
                    "--overwrite; an eval run's folder is refused)")
flags.DEFINE_string("title_note", "", "a line for the top of summary.md (how the inputs were produced)")


def merge(inputs, labels: dict[str, str]):
    from kascade_jax.eval import report  # noqa: PLC0415

    rows, records, fid, envs = [], [], {}, []
    for d in inputs:
        path = os.path.join(d, "results.json")
        if not os.path.isfile(path):
            raise ValueError(f"{d!r} holds no results.json")
        res = report.read_results_file(path)
        if "rows" not in res:
            raise ValueError(f"{path} holds no rows: not an experiments.eval results file")
        rename = labels.get(d) or labels.get(os.path.basename(os.path.normpath(d)))
        for r in res["rows"]:
            rows.append(dict(r, strategy=rename or r["strategy"]))
        for k, v in (res.get("fidelity") or {}).items():
            fid[(rename + " " + k.split(" ", 1)[1]) if rename else k] = dict(v, strategy=rename or v["strategy"])
        ex = report.examples_path(d)
        if ex:
            records += [dict(rec, strategy=rename or rec["strategy"]) for _, rec in report.iter_examples(ex)]
        envs.append(dict(res.get("environment", {}), source=d))
    return rows, records, fid, envs


def check_merged_dir(merged_dir: str, inputs) -> None:
    """An earlier merge in `merged_dir` is replaced only with --overwrite (`main` removes its result files once the
    inputs have been read, so no stale plot stays and a bad input leaves it whole); eval results there, or a file,
    are refused always: they could not be rebuilt."""
    from kascade_jax.eval import report  # noqa: PLC0415

    if os.path.normpath(merged_dir) in {os.path.normpath(d) for d in inputs}:
        raise ValueError(f"--merged_dir {merged_dir!r} is one of --inputs: choose another --merged_dir")
    if os.path.exists(merged_dir) and not os.path.isdir(merged_dir):
        raise ValueError(f"--merged_dir {merged_dir!r} is an existing file: choose another --merged_dir")
    data, _ = report.read_results(merged_dir)
    if data is not None and not str(data.get("environment", {}).get("command", "")).startswith("merged:"):
        raise ValueError(f"--merged_dir {merged_dir!r} holds the results of an eval run, not a merge: choose another "
                         f"--merged_dir")
    if os.path.isdir(merged_dir) and os.listdir(merged_dir) and not cli.OVERWRITE.value:
        held = sorted(os.listdir(merged_dir))
        raise ValueError(f"--merged_dir {merged_dir!r} is not empty (it holds {', '.join(held[:5])}): pass --overwrite "
                         f"to replace an earlier merge there, or choose another --merged_dir")
    report.check_writable(merged_dir, "--merged_dir")


def main(argv):
    del argv
    from kascade_jax.eval.sections import fidelity_section  # noqa: PLC0415
    from kascade_jax.eval import report  # noqa: PLC0415

    if not FLAGS.inputs:
        raise ValueError("--inputs must name at least one eval output directory")
    labels = {}
    for item in FLAGS.labels:
        if ":" not in item:
            raise ValueError(f"--labels entries look like input:label, got {item!r}")
        d, label = item.rsplit(":", 1)
        labels[d] = label
    check_merged_dir(FLAGS.merged_dir, FLAGS.inputs)
    rows, records, fid, envs = merge(FLAGS.inputs, labels)
    report.check_output_dir(FLAGS.merged_dir, overwrite=True)  # the earlier merge's files, now that the inputs read
    partial = [e["source"] for e in envs if e.get("partial")]
    env = dict(envs[0], command="merged: " + ", ".join(e.get("command", "") for e in envs),
               total_wall_s=sum(float(e.get("total_wall_s", 0)) for e in envs))
    env.pop("partial", None)
    if partial:  # the merge is partial when any input is, whichever came first
        env["partial"] = True
    sections = ([FLAGS.title_note] if FLAGS.title_note else [])
    if partial:
        sections.append(f"- unfinished runs (their finished blocks are included): {', '.join(partial)}")
    pivot = report.pivot_markdown(rows)
    if pivot:
        sections.append("## Strategy x context (task average, difference to dense; per task: score [95% CI])\n\n"
                        + pivot)
    if fid:
        sections.append(fidelity_section(fid))
    paths = report.write(rows, FLAGS.merged_dir, env=env, examples=records, extra=dict(fidelity=fid, sources=envs),
                         extra_sections=sections)
    print(pivot)
    print(f"Wrote {', '.join(str(p) for p in paths.values())}")


if __name__ == "__main__":
    cli.run(main)
