"""The trainer's environment as each service manager reads it back: supervisord's environment= line
(templates/program.conf.j2, parsed here by supervisor's own code: %-expansion, then a non-POSIX shlex
split without escapes) and the values it cannot hold, which the role refuses by name
(trainer_service_env_unquotable). systemd's root-only EnvironmentFile is read back by systemd itself in
tests/ansible/test_systemd_host.py."""

from __future__ import annotations

import pytest

from tests.unit.test_role_contracts import ROLES, render_role_var

VALUES = {
    "plain": "expandable_segments:True",
    "double quote, dollar, backslash, backtick, percent": 't0k$en"with\\backslash`and%',
    "single quote": "it's",
    "comma and equals": "a=b,c=d",
    "url with password": "https://user:p%40ss@mlflow.example/x",
}


def environment_line(env: dict, secrets: dict) -> str:
    """program.conf.j2's environment= line, rendered as Ansible would (Ansible imported here, not at
    collection: it patches sys.intern, which torch._dynamo then refuses to import)."""
    import jinja2

    program_env = render_role_var(
        "trainer_service",
        "trainer_service_program_env",
        {"trainer_service_env_all": env, "trainer_service_secret_env": secrets},
    )
    text = (ROLES / "trainer_service/templates/program.conf.j2").read_text()
    tmpl = jinja2.Environment(undefined=jinja2.StrictUndefined)
    out = tmpl.from_string(text).render(
        ansible_managed="managed",
        trainer_service_run_name="r",
        trainer_service_name="dflash-train",
        trainer_service_exec=["dflash", "train"],
        trainer_service_run_dir="/run",
        trainer_service_user="dflash",
        trainer_service_exit_codes={"ok": 0, "refused": 2},
        trainer_service_start_limit_burst=10,
        trainer_service_stop_timeout_s=600,
        trainer_service_stop_margin_s=120,
        trainer_service_program_env=program_env,
    )
    return next(x for x in out.splitlines() if x.startswith("environment="))[len("environment=") :]


def test_supervisord_reads_back_every_value_the_role_lets_through():
    from supervisor.datatypes import dict_of_key_value_pairs
    from supervisor.options import expand

    env = {"HOME": "/run", **{f"K{i}": v for i, v in enumerate(VALUES.values())}}
    secrets = {"WANDB_API_KEY": VALUES["double quote, dollar, backslash, backtick, percent"]}
    line = environment_line(env, secrets)
    parsed = dict_of_key_value_pairs(expand(line, {"here": "/etc"}, "environment"))
    assert parsed == {**env, **secrets}
    assert (
        render_role_var(
            "trainer_service",
            "trainer_service_env_unquotable",
            {"trainer_service_env_all": env, "trainer_service_secret_env": secrets},
        )
        == []
    )


@pytest.mark.parametrize(
    "value", ["both \" and '", "two\nlines", '"quoted at the start', "quoted at the end'"]
)
def test_a_value_supervisord_cannot_hold_is_named_before_anything_is_written(value):
    got = render_role_var(
        "trainer_service",
        "trainer_service_env_unquotable",
        {"trainer_service_env_all": {"HOME": "/run"}, "trainer_service_secret_env": {"TOKEN": value}},
    )
    assert got == ["TOKEN"]
