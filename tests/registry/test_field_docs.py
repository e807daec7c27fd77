"""registry.validation.field_docs: the string under each field, read from the source when
asked, and no model paying to read it as it is created."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, create_model

from registry.validation import field_docs

REPO = Path(__file__).resolve().parents[2]


class Base(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rate: float = 1.0
    """How fast.

    Second paragraph, dedented."""
    plain: int = 0
    told: str = Field(default="", description="Said in Field.")
    """Not this: the Field's description wins (as pydantic's own reading has it)."""


class Child(Base):
    class Inner(BaseModel):
        depth: int = 1
        """How deep (a nested class, by its dotted name)."""

    extra_knob: bool = False
    """Only the child has it."""
    inner: Inner = Field(default_factory=Inner)


def test_each_field_gets_the_string_under_it_from_its_class_or_a_base() -> None:
    assert field_docs(Base) == {"rate": "How fast.\n\nSecond paragraph, dedented.",
                                "plain": "", "told": "Said in Field."}
    docs = field_docs(Child)
    assert docs["rate"] == "How fast.\n\nSecond paragraph, dedented."  # inherited
    assert docs["extra_knob"] == "Only the child has it."
    assert docs["inner"] == ""
    assert field_docs(Child.Inner) == {"depth": "How deep (a nested class, by its dotted name)."}


def test_a_model_without_source_has_only_its_field_descriptions() -> None:
    made = create_model("Made", a=(int, 1), b=(int, Field(default=2, description="bee")))
    assert field_docs(made) == {"a": "", "b": "bee"}

    def local() -> type[BaseModel]:
        class Local(BaseModel):
            x: int = 0
            """A class inside a function: its qualified name is not in the file's classes."""

        return Local

    assert field_docs(local()) == {"x": ""}


def test_every_flag_derived_from_a_job_model_has_its_field_s_text() -> None:
    """agentctl finetune and export derive a flag from each field of their job models (some
    of them copies made by ``create_model``, which carry the text over): none is bare."""
    import argparse

    from agent.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command in ("finetune", "export"):
        bare = [a.option_strings for a in sub.choices[command]._actions
                if a.option_strings and not (a.help or "").strip()]
        assert not bare, (command, bare)


def test_importing_the_job_models_reads_no_source() -> None:
    """The job models are imported by every process of a device job: creating them must not
    read their source (pydantic's ``use_attribute_docstrings`` did, 0.2-0.4 CPU-s a process)."""
    code = (
        "import inspect, tokenize\n"
        "calls = []\n"
        "for mod, name in ((inspect, 'getsourcelines'), (inspect, 'findsource'),\n"
        "                  (tokenize, 'generate_tokens')):\n"
        "    f = getattr(mod, name)\n"
        "    setattr(mod, name,\n"
        "            lambda *a, _f=f, _n=name, **k: (calls.append(_n), _f(*a, **k))[1])\n"
        "import agent.jobs.spec, agent.daemon.config, contract.messages, hpc_core.config\n"
        "import fleet.rollout.plan, fleet.learn.plan, registry.principals\n"
        "print(calls)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]", out
