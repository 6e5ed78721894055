"""The `opentinker` command line: one entry point, a subcommand group per component.

This is the composition root: it wires each server's `serve` command (from its own package) next to the
client tools (registry admin, sample, status: all through the SDK), `up` and `demo`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from opentinker.cli.options import AsJson, CaCert, Token

app = typer.Typer(no_args_is_help=True, help="OpenTinker: train and serve many LoRA policies on one base LLM.")


@app.command("make-tiny-model")
def make_tiny_model_command(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model and tokenizer into.")],
    arch: Annotated[str, typer.Option(help="qwen2 or llama.")] = "qwen2",
    seed: Annotated[int, typer.Option(help="Weights seed; same seed, same bytes.")] = 0,
    hidden_size: Annotated[int, typer.Option(help="Hidden size.")] = 64,
    intermediate_size: Annotated[int, typer.Option(help="MLP intermediate size.")] = 128,
    layers: Annotated[int, typer.Option(help="Number of decoder layers.")] = 2,
    heads: Annotated[int, typer.Option(help="Attention heads.")] = 4,
    kv_heads: Annotated[int, typer.Option(help="Key/value heads (grouped-query attention).")] = 2,
    vocab_size: Annotated[int, typer.Option(help="Tokenizer vocabulary size incl. special tokens.")] = 512,
    like: Annotated[
        str | None,
        typer.Option(
            help="A scaled copy of a public checkpoint's config: llama3.2, llama3.1, qwen2.5, qwen2.5-yarn, "
            "qwen3, qwen3-8b or mistral (sizes shrunk, every other key as published)."
        ),
    ] = None,
) -> None:
    """Write a small random causal LM + byte-level BPE tokenizer, offline and deterministically."""
    from opentinker.client.model_families import FAMILIES
    from opentinker.client.tiny_model import TinyModelSpec, make_family_model, make_tiny_model

    if like is not None:
        if like not in FAMILIES:
            raise typer.BadParameter(f"must be one of {', '.join(FAMILIES)}", param_hint="--like")
        path = make_family_model(out_dir, like, seed=seed, vocab_size=vocab_size)
        typer.echo(f"wrote a scaled copy of {FAMILIES[like][0]} to {path}")
        return
    if arch not in ("qwen2", "llama"):
        raise typer.BadParameter("arch must be qwen2 or llama", param_hint="--arch")
    spec = TinyModelSpec(
        arch=arch,  # type: ignore[arg-type]
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        seed=seed,
    )
    path = make_tiny_model(out_dir, spec)
    typer.echo(f"wrote {arch} model to {path}")


def _register_groups() -> None:
    from opentinker.cli.fleet import fleet_app
    from opentinker.cli.fleet_haproxy import haproxy_command
    from opentinker.cli.registry_admin import add_admin_commands
    from opentinker.cli.sample import sample_command
    from opentinker.cli.trainer_admin import add_trainer_commands
    from opentinker.gateway.cli import app as gateway_app
    from opentinker.registry.cli import registry_app
    from opentinker.sampler_server.cli import sampler_app
    from opentinker.trainer_server.cli import trainer_app

    add_admin_commands(registry_app)
    add_trainer_commands(trainer_app)
    app.add_typer(registry_app, name="registry", help="Run and administer the adapter registry.")
    app.add_typer(trainer_app, name="trainer", help="Run and operate the trainer server.")
    app.add_typer(sampler_app, name="sampler", help="Run the sampler server.")
    app.add_typer(gateway_app, name="gateway", help="Run the Tinker-compatible HTTP gateway.")
    fleet_app.command("haproxy")(haproxy_command)
    app.add_typer(fleet_app, name="fleet", help="See the fleet of replicas the registry knows.")
    app.command("sample")(sample_command)


_register_groups()


@app.command("status")
def status_command(
    registry: Annotated[str | None, typer.Option(envvar="OPENTINKER_REGISTRY", help="Registry address.")] = None,
    trainer: Annotated[str | None, typer.Option(envvar="OPENTINKER_TRAINER", help="Trainer address.")] = None,
    sampler: Annotated[str | None, typer.Option(envvar="OPENTINKER_SAMPLER", help="Sampler address.")] = None,
    workdir: Annotated[
        Path, typer.Option(help="Without addresses: the `opentinker up` workdir whose stack to show (its stack.json).")
    ] = Path("."),
    token: Token = None,
    ca_cert: CaCert = None,
    as_json: AsJson = False,
) -> None:
    """One screen on the running stack; exits 1 when a server is not serving, 2 when there is no stack to show."""
    from opentinker.cli.stack_file import NoStack, read_stack_file
    from opentinker.cli.status import show_status

    if not (registry or trainer or sampler):
        try:
            stack = read_stack_file(workdir)
        except NoStack as exc:
            typer.echo(f"opentinker status: {exc}; pass --workdir, or --registry/--trainer/--sampler", err=True)
            raise typer.Exit(2) from None
        registry, trainer, sampler = (stack.addresses.get(s) for s in ("registry", "trainer", "sampler"))
        token = token or stack.token()
    if not show_status(registry, trainer, sampler, token, ca_cert, as_json):
        raise typer.Exit(1)


@app.command("up")
def up_command(
    config: Annotated[
        Path, typer.Option(exists=True, dir_okay=False, help="TOML file: server sections, shared keys and [up].")
    ],
    workdir: Annotated[
        Path | None,
        typer.Option(
            help="Logs, ready files, stack.json and (unless the file names a data_dir) the registry's data; one `up` "
            "at a time (default: [up] workdir, else ./opentinker-up)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON line when serving and one when stopped.")] = False,
    store: Annotated[
        str | None,
        typer.Option(
            help="Every server's artifact store, over the file's: a folder or s3://, az://, gs:// URL (a bucket: "
            "the trainer and sampler cache under WORKDIR/<server>/cache unless the file names a cache_dir)."
        ),
    ] = None,
) -> None:
    """Start registry, trainer and sampler from one config file; Ctrl-C or SIGTERM stops them all."""
    from opentinker.cli.stack import run_up

    raise typer.Exit(run_up(config, workdir, as_json, store))  # a config it cannot use: one line, exit 2


@app.command("demo")
def demo_command(
    workdir: Annotated[Path, typer.Option(help="Where the demo writes models, Redis data and logs.")] = Path(
        "demo-data"
    ),
    out: Annotated[Path, typer.Option(help="Where curves.png and metrics.jsonl go.")] = Path("demo_out"),
    steps: Annotated[int, typer.Option(help="Training steps per adapter.")] = 20,
) -> None:
    """Run the end-to-end demo on a locally generated tiny model."""
    from opentinker.cli.demo import run_demo

    run_demo(workdir, out, steps)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
