"""GPU offload settings (``--n-gpu-layers``, ``--main-gpu``, ``--split-mode``,
``--tensor-split``) on the CPU-only llama-cpp-python build this suite runs on: they are read
from flags, ``SHMKV_*`` and TOML, refused with a clear message when wrong, reach each
worker's ``Llama``; such a build warns once per process and runs on the CPU, under the CPU
budget, keyed as a CPU context. What a GPU changes (the budget rule, the fingerprint) is
tested on its decision functions: no GPU here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import llama_cpp
import pytest

from shmkv.core.config import resolve
from shmkv.core.errors import ConfigError
from shmkv.llama import offload
from shmkv.llama.cpu import budget as cpubudget
from shmkv.serving.model_settings import model_settings
from shmkv.serving.runner import settings_env
from tests.support.cli import assert_one_error_line, clean_env, shmkv
from tests.support.llama_workers import KW, SYSTEM, completion, run_worker
from tests.support.servers import EXTRA, SAMPLING, Server

WARNING = "cannot offload to a GPU"
GPU_ENV = {
    "SHMKV_N_GPU_LAYERS": "99",
    "SHMKV_SPLIT_MODE": "row",
    "SHMKV_MAIN_GPU": "1",
    "SHMKV_TENSOR_SPLIT": "3,1",
}

pytestmark = pytest.mark.skipif(
    offload.supports_gpu_offload(), reason="these tests are of a build without GPU offload"
)


# ------------------------------------------------------------------------ settings
def test_gpu_settings_from_flags_env_and_config_file(tmp_path):
    d = resolve("serve", env={})
    assert (d.n_gpu_layers, d.main_gpu, d.split_mode, d.tensor_split) == (0, 0, "layer", None)
    cfg = tmp_path / "shmkv.toml"
    cfg.write_text('n-gpu-layers = "all"\nsplit_mode = "NONE"\ntensor_split = [1, 0.5]\n')
    f = resolve("serve", env={}, config_file=str(cfg))
    assert (f.n_gpu_layers, f.split_mode, f.tensor_split) == (-1, "none", [1.0, 0.5])
    e = resolve("serve", env={"SHMKV_CONFIG": str(cfg), **GPU_ENV})
    assert (e.n_gpu_layers, e.main_gpu, e.split_mode, e.tensor_split) == (99, 1, "row", [3, 1])
    c = resolve("serve", {"n_gpu_layers": "-1", "tensor_split": "0,2"}, env=GPU_ENV)
    assert (c.n_gpu_layers, c.tensor_split, c.sources["n_gpu_layers"]) == (
        -1,
        [0.0, 2.0],
        "--n-gpu-layers",
    )
    # as `shmkv serve` hands them to its workers, and back
    again = resolve("serve", env=settings_env(c))
    assert {k: again.values[k] for k in GPU_SETTINGS} == {k: c.values[k] for k in GPU_SETTINGS}


GPU_SETTINGS = ("n_gpu_layers", "main_gpu", "split_mode", "tensor_split")


@pytest.mark.parametrize(
    "var, value, needle",
    [
        ("SHMKV_N_GPU_LAYERS", "-2", "-1 or all for every layer"),
        ("SHMKV_N_GPU_LAYERS", "many", "SHMKV_N_GPU_LAYERS"),
        ("SHMKV_MAIN_GPU", "-1", "zero or a positive integer"),
        ("SHMKV_SPLIT_MODE", "diagonal", "use none, layer or row"),
        ("SHMKV_TENSOR_SPLIT", "3;1", "comma-separated numbers, e.g. 3,1"),
        ("SHMKV_TENSOR_SPLIT", "3,-1", "zero or a positive number"),
        ("SHMKV_TENSOR_SPLIT", "0,0", "give at least one GPU a share"),
        ("SHMKV_TENSOR_SPLIT", "1,nan", "zero or a positive number"),
    ],
)
def test_wrong_gpu_settings_are_refused_with_the_fix(var, value, needle):
    with pytest.raises(ConfigError) as e:
        resolve("serve", env={var: value})
    assert str(e.value).startswith(var + ":") and needle in str(e.value), e.value


def test_shmkv_serve_refuses_a_wrong_split_mode_in_one_line():
    res = shmkv("serve", "--split-mode", "diagonal", env=clean_env())
    assert_one_error_line(res, "--split-mode", "use none, layer or row")
    help_text = shmkv("serve", "--help").stdout
    for flag in ("--n-gpu-layers", "--main-gpu", "--split-mode", "--tensor-split"):
        assert flag in help_text


def test_the_settings_reach_a_served_workers_model_settings(models):
    ms = model_settings(resolve("serve", env=GPU_ENV), models["seed0"], threads=1)
    assert (ms.n_gpu_layers, ms.main_gpu, ms.split_mode, ms.tensor_split) == (
        99,
        1,
        llama_cpp.LLAMA_SPLIT_MODE_ROW,
        [3.0, 1.0],
    )


# ------------------------------------------------------------------------ decisions
def test_offloaded_layers_are_what_llama_cpp_puts_on_a_device():
    n_layer = 24
    assert offload.offloaded_layers(99, n_layer, supported=False) == 0
    assert offload.offloaded_layers(0, n_layer, supported=True) == 0
    assert offload.offloaded_layers(10, n_layer, supported=True) == 10
    assert offload.offloaded_layers(24, n_layer, supported=True) == 24  # (output on the CPU)
    assert offload.offloaded_layers(99, n_layer, supported=True) == 25
    assert offload.offloaded_layers(-1, n_layer, supported=True) == 25
    assert offload.offloaded_layers(offload.ALL_LAYERS, n_layer, supported=True) == 25


def test_only_a_fully_offloaded_context_evaluates_off_the_cpu_budget():
    n_layer = 24
    assert offload.evaluates_on_cpu(0, n_layer, offload_kqv=True)
    assert offload.evaluates_on_cpu(12, n_layer, offload_kqv=True)  # half the layers
    assert offload.evaluates_on_cpu(24, n_layer, offload_kqv=True)  # the output layer
    assert offload.evaluates_on_cpu(25, n_layer, offload_kqv=False)  # attention on the CPU
    assert not offload.evaluates_on_cpu(25, n_layer, offload_kqv=True)


def test_contexts_offloaded_differently_are_keyed_apart():
    """A state's numbers are those of the device that computed them: a context with layers
    on a GPU never shares keys with a CPU one, nor with one offloaded otherwise. A context
    on the CPU is described as before offload existed (its keys do not change)."""
    assert offload.describe(0, 1, 0, []) is None
    row, layer = llama_cpp.LLAMA_SPLIT_MODE_ROW, llama_cpp.LLAMA_SPLIT_MODE_LAYER
    seen = [
        offload.describe(25, layer, 0, []),
        offload.describe(12, layer, 0, []),
        offload.describe(25, row, 0, []),
        offload.describe(25, layer, 1, []),
        offload.describe(25, layer, 0, [3, 1]),
    ]
    assert None not in seen
    assert len({json.dumps(d, sort_keys=True) for d in seen}) == len(seen)


# ------------------------------------------------------------------------ a CPU-only build
_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING)
    from shmkv.core.config import resolve
    from shmkv.llama import offload
    from shmkv.llama.cpu import budget
    from shmkv.llama.fingerprint import model_fingerprint
    from shmkv.serving.model_settings import load_llama

    model, prompt, sampling = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    cpu = load_llama(resolve("serve", env={}), model, threads=1)
    gpu_settings = resolve("serve")
    gpu = load_llama(gpu_settings, model, threads=1)
    again = load_llama(gpu_settings, model, threads=1)
    b = budget.for_settings(gpu_settings, gpu)
    p = gpu.model_params
    print(json.dumps({
        "params": [p.n_gpu_layers, p.split_mode, p.main_gpu, gpu.tensor_split],
        "text": [m.create_completion(prompt, **sampling)["choices"][0]["text"]
                 for m in (cpu, gpu, again)],
        "same_key": model_fingerprint(gpu) == model_fingerprint(cpu),
        "uses_cpu": offload.uses_cpu(gpu),
        "budget": b is not None,
    }))
    if b is not None:
        b.close()
    """
)


def test_a_cpu_only_build_warns_once_per_process_and_runs_on_the_cpu(models, tmp_path):
    """Two models loaded with GPU settings in one process: llama.cpp got them, one warning
    names the fix, the answers equal a CPU context's, the evals are under the CPU budget,
    and the states are keyed as a CPU context's (they are computed on the CPU)."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    name = f"gpu-{tmp_path.name}"
    env = clean_env(SHMKV_NAME=name, SHMKV_DIR=str(tmp_path), **GPU_ENV)
    try:
        res = subprocess.run(
            [sys.executable, "-c", _SCRIPT, models["seed0"], prompt, json.dumps(SAMPLING | EXTRA)],
            capture_output=True,
            text=True,
            timeout=240,
            env=env,
        )
    finally:  # (as gunicorn's master does: the budget's bell is in /dev/shm)
        cpubudget.remove(str(tmp_path), name)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["params"] == [99, llama_cpp.LLAMA_SPLIT_MODE_ROW, 1, [3.0, 1.0]]
    assert out["text"][0] == out["text"][1] == out["text"][2] and out["text"][0]
    assert res.stderr.count(WARNING) == 1, res.stderr
    assert 'CMAKE_ARGS="-DGGML_CUDA=on" pip install' in res.stderr
    assert out == {**out, "same_key": True, "uses_cpu": True, "budget": True}


def test_served_workers_on_a_cpu_only_build_warn_once_per_deployment_and_share_states(
    tmp_path, serve_model, serve_reference, make_supervisor
):
    """`shmkv serve --n-gpu-layers 99` on this build: the master warns once before it forks
    (not once per worker), each worker serves,
    its prefill runs on cores of the CPU budget, answers equal a cold run's, and a second
    worker restores the first one's state."""
    sup = make_supervisor("--size", "64M")
    srv = Server(sup, serve_model, workers=2, tmp_path=tmp_path, env=GPU_ENV)
    prompt = "Once upon a time " * 40
    try:
        first_text, first = srv.complete(prompt)
        asked, _ = srv.until_other_worker(lambda i: prompt, first["worker_pid"])
        assert all(text == first_text for _, text, _ in asked)
        got = [first] + [info for _, _, info in asked]
        pids = srv.worker_pids()
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert first_text == serve_reference(prompt)
    assert first["prefill_threads"] >= 1 and first["evaluated_tokens"] > 64
    other = [i for i in got if i["worker_pid"] != first["worker_pid"]]
    assert other and other[0]["restored_tokens"] >= 64, got
    warnings = [ln for ln in log.splitlines() if WARNING in ln]
    assert len(warnings) == 1 and len(pids) == 2, log[-3000:]
    assert int(warnings[0].split("[")[1].split("]")[0]) not in pids  # the master's


def test_shmkv_warm_takes_the_settings_and_warns_once(make_supervisor, models, tmp_path):
    """`shmkv warm --n-gpu-layers all` on this build: one warning, the prompt warmed, and a
    CPU worker restores it (what ran on the CPU is keyed as the CPU's)."""
    sup = make_supervisor("--size", "64M")
    prompt = SYSTEM + " Question: which mat is the cat on?"
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(prompt) + "\n")
    args = ["--model", models["seed0"], "--n-ctx", str(KW["n_ctx"]), "--json", str(path)]
    res = subprocess.run(
        [sys.executable, "-m", "shmkv", "warm", "--n-gpu-layers", "all", *args],
        env=sup.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert res.stderr.count(WARNING) == 1, res.stderr
    assert json.loads(res.stdout)["warmed"] == 1
    hot = run_worker(sup, models["seed0"], [completion(prompt)])
    last = hot["results"][0]["last"]
    assert last["tokens_restored"] >= last["prompt_tokens"] - 1 > 1000


# --------------------------------------------------------------- a build compiled for AMX
_AMX_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING)
    from llama_cpp import llama_cpp as lc
    from shmkv.core.config import resolve
    from shmkv.llama import offload
    from shmkv.llama.fingerprint import model_fingerprint
    from shmkv.serving.model_settings import load_llama

    model, prompt, sampling = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    settings = resolve("serve", env={})
    default = load_llama(settings, model, threads=1)
    offload.amx_weight_buffers = lambda: True  # what a build compiled for AMX reports
    amx = [load_llama(settings, model, threads=1) for _ in range(2)]
    print(json.dumps({
        "extra_bufts": [m.model_params.use_extra_bufts for m in (default, *amx)],
        "after": bool(lc.llama_model_default_params().use_extra_bufts),
        "text": [m.create_completion(prompt, **sampling)["choices"][0]["text"]
                 for m in (default, *amx)],
        "keys": [model_fingerprint(m).hex() for m in (default, *amx)],
    }))
    """
)


def test_a_build_compiled_for_amx_loads_served_models_without_its_weight_buffers(models):
    """llama.cpp's AMX weight buffers crash on Q4_K weights (llama.cpp#20824): a build that
    reports AMX loads served workers' models with ``use_extra_bufts`` off, warns once per
    process with the way out, and keys their states apart (other kernels); the default is
    back after the load, and a build without AMX (this one) keeps llama.cpp's buffers."""
    assert offload.amx_weight_buffers() is (b"AMX_INT8 = 1" in llama_cpp.llama_print_system_info())
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    res = subprocess.run(
        [sys.executable, "-c", _AMX_SCRIPT, models["seed0"], prompt, json.dumps(SAMPLING | EXTRA)],
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env(),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["extra_bufts"] == [True, False, False]
    assert out["after"] is True
    assert out["text"][0] == out["text"][1] == out["text"][2] and out["text"][0]  # (F32)
    assert out["keys"][1] == out["keys"][2] != out["keys"][0]
    assert res.stderr.count("llama.cpp#20824") == 1, res.stderr
    assert "docs/guides/serving.md, a CPU with AMX" in res.stderr


_DEPLOYMENT_SCRIPT = textwrap.dedent(
    """
    import logging, os, runpy, sys
    from shmkv.llama import offload
    from shmkv.serving.model_settings import load_llama
    from shmkv.core.config import resolve

    offload.amx_weight_buffers = lambda: True  # what a build compiled for AMX reports
    conf = runpy.run_path(sys.argv[1])  # the gunicorn config, as gunicorn's master reads it
    conf["on_starting"](None)
    workers = []
    for _ in range(3):  # gunicorn forks its workers from the master after on_starting
        pid = os.fork()
        if pid == 0:
            load_llama(resolve("serve"), sys.argv[2], threads=1)
            os._exit(0)
        workers.append(pid)
    sys.exit(max(os.waitpid(pid, 0)[1] for pid in workers))
    """
)


def test_a_build_compiled_for_amx_warns_once_per_deployment_not_per_worker(models):
    """The gunicorn master gives the AMX warning before it forks its workers, which inherit
    having given it: one line for a deployment of three workers (three before)."""
    from shmkv.serving.runner import gunicorn_conf_path

    res = subprocess.run(
        [sys.executable, "-c", _DEPLOYMENT_SCRIPT, str(gunicorn_conf_path()), models["seed0"]],
        capture_output=True,
        text=True,
        timeout=240,
        env=clean_env(SHMKV_MODEL=models["seed0"], SHMKV_LOG_LEVEL="warning"),
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stderr.count("llama.cpp#20824") == 1, res.stderr
