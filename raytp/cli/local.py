"""Commands that run here: train a job (an embedded Ray, or a cluster it joins), export, sample.

    raytp train jobs/default.yaml --set parallel.tp=4
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from raytp.cli.base import ended_line, fail, failed, keys_help, main


@main.command(epilog=keys_help())
@click.argument("job", type=click.Path(dir_okay=False))
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override a job key, e.g. --set parallel.tp=4 (repeatable; beats the file).")
@click.option("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else an embedded local Ray).")
@click.option("--run-dir", default=None, help="Run directory (default: runs/<name>).")
@click.option("--name", default=None, help="Run name (default: the run directory's last component).")
@click.option("--resume", is_flag=False, flag_value="latest", default=None, metavar="[PATH]",
              help="Resume from a checkpoint dir, or the newest whole checkpoint of a run dir; "
                   "alone, from this run's own. Any valid layout: weights and optimizer state are resharded.")
def train(job, sets, address, run_dir, name, resume):
    """Train the model of JOB (a YAML job file) on a Ray cluster."""
    from raytp import api  # the command is raytp.train's messages and exit statuses
    try:
        result = api.train(job, sets, address=address, run_dir=run_dir, resume=resume, name=name)
    except api.Interrupted as e:
        click.echo(f"[raytp] {e}", err=True)
        sys.exit(e.exit_code)
    except api.TrainError as e:
        if e.__cause__ is not None:  # a run's error: its traceback with --debug
            failed(e.__cause__, e.exit_code)
        fail(str(e), e.exit_code)
    click.echo(ended_line(result.state, result.steps, result.seconds, result.loss, result.val_loss,
                          result.run_dir), err=True)


@main.command()
@click.argument("source")
@click.option("--out", required=True, type=click.Path(), help="Output file (raytp) or directory (hf).")
@click.option("--format", "fmt", type=click.Choice(["raytp", "hf"]), default="raytp", show_default=True,
              help="raytp: one file raytp.models.files.load_model reads; hf: a GPT-2 or Llama directory for transformers.")
@click.option("--tokenizer", default=None, type=click.Path(exists=True),
              help="tokenizer.json (or a directory holding one) to ship with the model; only what is named here is "
                   "shipped (a run dir's data.tokenizer is named, not read).")
@click.option("--init-from", "init_from", default=None, type=click.Path(exists=True, file_okay=False),
              help="hf: the Hugging Face directory the run started from (its model.init_from): its special ids, "
                   "generation_config.json and tokenizer side files are shipped.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="hf: the weights' dtype (training keeps fp32 masters: fp32 is exact, bf16 half the size).")
@click.option("--max-shard-size", default=None, metavar="SIZE",
              help="hf: files of at most SIZE (5GB, 500MB, 1GiB, bytes) with model.safetensors.index.json "
                   "past it; default 5GB.")
@click.option("--overwrite", is_flag=True, help="raytp: replace an existing --out file (never a directory).")
def export(source, out, fmt, tokenizer, init_from, dtype, max_shard_size, overwrite):
    """Write the model of SOURCE (a run dir, a checkpoint dir, or a URL of either) as one raytp file or a
    Hugging Face directory, tensor by tensor."""
    from raytp.files import checkpoint
    from raytp.files.interop import export as export_mod
    from raytp.files.checkpoint_manifest import check_model_tensors
    from raytp.data import tokens as tok_mod
    try:
        tok = tok_mod.tokenizer_file(tokenizer, "--tokenizer") if tokenizer else None
        if tok is not None:
            tok_mod.load(str(tok), "--tokenizer")  # a tokenizer, whole, before its text is shipped
        if fmt == "raytp" and (dtype != "fp32" or max_shard_size or init_from):
            raise ValueError("--dtype, --max-shard-size and --init-from: only with --format hf (a raytp file is fp32, "
                             "one file)")
        export_mod.check_out(Path(out), fmt, overwrite)
        for line in export_mod.unshipped(source, tokenizer, init_from):
            click.echo(f"[raytp] note: {line}", err=True)
        ckpt = checkpoint.find(source, warn=lambda m: click.echo(f"[raytp] warning: {m}", err=True))
        if "tensors" in ckpt.manifest:  # every entry at its model's shape: no byte of another tensor exported
            check_model_tensors(ckpt.manifest, ckpt.where)
        if fmt == "hf":
            from raytp.files.interop.hf import DEFAULT_SHARD_SIZE
            export_mod.write_hf(ckpt, Path(out), dtype, max_shard_size or DEFAULT_SHARD_SIZE, tok,
                                Path(init_from) if init_from else None)
        else:
            export_mod.write_model(ckpt, Path(out), tok, overwrite)
    except checkpoint.CheckpointError as e:
        fail(e, 1)
    except ValueError as e:
        fail(str(e), 2)
    click.echo(f"[raytp] exported step {ckpt.step} of {ckpt.where} ({fmt}{', ' + dtype if fmt == 'hf' else ''}) "
               f"to {out}", err=True)


@main.command()
@click.argument("model_file", type=click.Path(exists=True, dir_okay=False))
@click.option("--prompt", default="\n", show_default=True, help="Text to continue.")
@click.option("--tokens", default=200, show_default=True, help="Tokens to generate.")
@click.option("--temperature", default=0.8, show_default=True, help="0 = greedy.")
@click.option("--top-k", default=None, type=int, help="Sample among the k likeliest tokens only.")
@click.option("--seed", default=0, show_default=True)
@click.option("--tokenizer", default=None, type=click.Path(exists=True),
              help="tokenizer.json (or a directory holding one); default: the one the file carries, else bytes.")
@click.option("--chat", is_flag=True, help="The prompt is a user turn: rendered with the chat template (the "
              "tokenizer's, or the one the file carries) and answered until the end of the turn.")
def sample(model_file, prompt, tokens, temperature, top_k, seed, tokenizer, chat):
    """Generate text from MODEL_FILE (written by `raytp export`), encoded and decoded with its tokenizer."""
    import torch
    from raytp.models.files import load_model
    from raytp.data import tokens as tok_mod
    from raytp.files.interop.export import embedded_tokenizer
    try:
        model = load_model(model_file)
    except ValueError as e:
        fail(e, 1)
    try:
        tok = tok_mod.load(tokenizer, "--tokenizer") if tokenizer else None
    except ValueError as e:
        fail(str(e), 2)  # a bad argument, as export's
    if tok is None and (text := embedded_tokenizer(model_file)) is not None:
        tok = tok_mod.from_json(text)
    if tok is None and model.cfg.vocab_size > 256:
        fail(f"{model_file}: vocabulary of {model.cfg.vocab_size} is not byte level and the file carries no "
             "tokenizer; pass --tokenizer", 1)
    stop = None
    if chat:
        ids, stop = _chat_prompt(model_file, tokenizer, tok, prompt)
    else:
        ids = tok.encode(prompt, add_special_tokens=False).ids if tok is not None else list(prompt.encode())
    g = torch.Generator().manual_seed(seed)
    out = model.generate(torch.tensor([ids], dtype=torch.long), tokens, temperature=temperature, top_k=top_k,
                         generator=g, stop=stop)[0].tolist()
    if chat:  # the answer alone, up to its end of turn
        out = out[len(ids):]
        out = out[:out.index(stop)] if stop in out else out
    click.echo(tok.decode(out) if tok is not None else bytes(out).decode("utf-8", errors="replace"))


def _chat_prompt(model_file, tokenizer, tok, prompt: str) -> tuple[list[int], int | None]:
    """sample --chat: the prompt as a user turn and the end-of-turn id; one error line if there is no
    template (status 2)."""
    import json as json_mod
    from raytp.data.prepare import chat as chat_mod
    from raytp.files.interop.chat_template import chat_spec, find_template
    from raytp.data.tokens import tokenizer_file
    from raytp.files.interop.export import embedded_tokenizer
    if tok is None:
        fail(f"--chat: {model_file} carries no tokenizer; pass --tokenizer (a directory with a chat template)", 2)
    spec = None
    try:
        if tokenizer is not None:
            path = tokenizer_file(tokenizer, "--tokenizer")
            template, _ = find_template(path)
            spec = chat_spec(path, template) if template is not None else None
        elif (text := embedded_tokenizer(model_file, "chat")) is not None:
            spec = json_mod.loads(text)
    except ValueError as e:
        fail(str(e), 2)
    if spec is None:
        fail(f"--chat: no chat template in {tokenizer or model_file} (a tokenizer_config.json chat_template or "
             "a chat_template.jinja beside the tokenizer)", 2)
    renderer = chat_mod.renderer(tok.to_str(), spec)
    return chat_mod.prompt_ids(renderer, prompt)
