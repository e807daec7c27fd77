"""``reference/job-state-machine.md``: the device job's transitions per job type, from the
table the worker itself replays (``agent.jobs.machine``)."""

from __future__ import annotations

import inspect

from refgen import GENERATED_NOTE
from refgen.text import md_text, rst_inline


def _first_line(obj: object) -> str:
    """The first paragraph of ``obj``'s docstring, else of its module's."""
    doc = inspect.getdoc(obj) or inspect.getdoc(inspect.getmodule(obj)) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def job_machine_page() -> str:
    from agent.jobs import machine

    doc = inspect.cleandoc(machine.__doc__ or "")
    paras = doc.split("\n\n")
    out = [GENERATED_NOTE, "", "# Device job state machine", "",
           md_text(rst_inline(paras[0])), "",
           "```text", inspect.cleandoc(paras[1]).replace("\\\\", "\\"), "```", ""]
    out += [md_text(rst_inline(paras[2])), ""]
    out += ["How the job runs, step by step, and how to add a job type: "
            "[the device job](../explanation/device-job.md).", ""]
    for job_type, table in machine.TRANSITIONS.items():
        out += [f"## `{job_type}`", "", "| state | event | next state |", "|---|---|---|"]
        out += [f"| `{state}` | `{event}` | `{nxt}` |" for (state, event), nxt in table.items()]
        out.append("")
    out += ["## The steps", "", "What the worker runs in each state (`WORKER_STEPS`): one module "
            "per step, which also holds the step's torch half.", "",
            "| state | function | what it does |", "|---|---|---|"]
    for state, step in machine.WORKER_STEPS.items():
        out.append(f"| `{state}` | `{step.__module__}.{step.__name__}` | "
                   f"{md_text(_first_line(step))} |")
    out.append("")
    cancel = ", ".join(f"`{s}`" for s in sorted(machine.NOT_CANCELABLE))
    ends = ", ".join(f"`{s}`" for s in sorted(machine.ENDS))
    out += [f"End states: {ends}. Steps that still run after a cancel: {cancel}.", ""]
    return "\n".join(out).rstrip() + "\n"
