"""SGLang's own clients, lm-eval and the openai client against the tiny server, unchanged.

Each client runs as its users run it: its own command line with only host/port/tokenizer/data
arguments (and sizes that keep a CPU run short), from the clients' virtualenv
(`DSPARK_CLIENTS_PYTHON`, set by `test/clients/run_client_tests.sh`; the tests skip without
it). The server runs from this repository, with DSpark (the default of `make serve`) and, for
bench_serving, without it. Nothing is downloaded: the prompts come from random token ids and
the repository's GSM8K fixture, the tokenizer from the server's `/model_info`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "registered" / "e2e"))

from server_fixture import ServerProcess, running_server  # noqa: E402

CLIENTS_PYTHON = os.environ.get("DSPARK_CLIENTS_PYTHON")
GSM8K = REPO / "test" / "registered" / "unit" / "data" / "gsm8k_mini" / "test.jsonl"
CLIENT_TIMEOUT_S = 600

pytestmark = pytest.mark.skipif(
    not CLIENTS_PYTHON,
    reason="set DSPARK_CLIENTS_PYTHON to the clients' venv: bash test/clients/run_client_tests.sh",
)


def _client_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        PYTHONWARNINGS="ignore",
    )
    env.pop("PYTHONPATH", None)  # the clients must not see this repository's packages
    return env


def run_client(*args: str, cwd: Path | None = None) -> str:
    assert CLIENTS_PYTHON
    proc = subprocess.run(
        [CLIENTS_PYTHON, *args],
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        env=_client_env(),
        cwd=cwd,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{args[:3]} exited with {proc.returncode}:\n{out[-4000:]}"
    return out


def _port(server: ServerProcess) -> str:
    return server.base_url.rsplit(":", 1)[1]


# The model `make serve` serves (the built-in DeepSeek-V4.1 with its DSpark draft).
SERVED_MODEL = "tiny-v41"


@pytest.fixture(scope="module")
def dspark_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("clients") / "server.log"
    with running_server(
        log,
        "--model-path",
        SERVED_MODEL,
        "--speculative-algorithm",
        "DSpark",
        "--max-running-requests",
        "8",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("clients") / "server.log"
    with running_server(log, "--model-path", SERVED_MODEL, "--max-running-requests", "8") as s:
        yield s


def _bench(server: ServerProcess, backend: str, out: Path) -> dict:
    run_client(
        "-m",
        "sglang.bench_serving",
        "--backend",
        backend,
        "--host",
        "127.0.0.1",
        "--port",
        _port(server),
        "--dataset-name",
        "random-ids",
        "--num-prompts",
        "6",
        "--random-input-len",
        "24",
        "--random-output-len",
        "12",
        "--output-file",
        str(out),
    )
    return json.loads(out.read_text().splitlines()[-1])


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "sglang-oai-chat"])
def test_bench_serving_with_dspark(dspark_server, tmp_path, backend):
    result = _bench(dspark_server, backend, tmp_path / "bench.jsonl")
    assert result["completed"] == 6
    assert result["total_output_tokens"] > 0
    # bench_serving reads the mean acceptance length from /server_info's internal_states.
    assert result["accept_length"] is not None and result["accept_length"] >= 1.0


def test_bench_serving_without_dspark(plain_server, tmp_path):
    result = _bench(plain_server, "sglang", tmp_path / "bench.jsonl")
    assert result["completed"] == 6
    assert result["accept_length"] is None


def test_few_shot_gsm8k(dspark_server, tmp_path):
    out = run_client(
        "-m",
        "sglang.test.few_shot_gsm8k",
        "--host",
        "127.0.0.1",
        "--port",
        _port(dspark_server),
        "--data-path",
        str(GSM8K),
        "--num-questions",
        "20",
        "--max-new-tokens",
        "16",
        "--parallel",
        "8",
        cwd=tmp_path,  # it writes tmp_output_gsm8k.txt into the working directory
    )
    # A random tiny model answers nothing right; the client must finish and report.
    assert "Accuracy:" in out and "Invalid:" in out


def _tokenizer_dir(server: ServerProcess) -> str:
    info = httpx.get(f"{server.base_url}/model_info", timeout=30).json()
    assert os.path.isfile(os.path.join(info["tokenizer_path"], "tokenizer.json"))
    return str(info["tokenizer_path"])


def _lm_eval(server: ServerProcess, tmp_path: Path, task_yaml: str, task: str) -> dict:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{task}.yaml").write_text(task_yaml)
    model_args = ",".join(
        [
            f"model={SERVED_MODEL}",
            f"base_url={server.base_url}/v1/completions",
            f"tokenizer={_tokenizer_dir(server)}",
            "num_concurrent=4",
            "max_retries=1",
        ]
    )
    run_client(
        "-m",
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--include_path",
        str(tasks),
        "--tasks",
        task,
        "--limit",
        "20",
        "--output_path",
        str(tmp_path / "results"),
        cwd=tmp_path,
    )
    [path] = list((tmp_path / "results").rglob("results_*.json"))
    return json.loads(path.read_text())["results"][task]


def test_lm_eval_generation(dspark_server, tmp_path):
    task_yaml = f"""task: dspark_gsm8k_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {GSM8K}
output_type: generate_until
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer.split('#### ')[-1]}}}}"
generation_kwargs:
  until: ["Question:"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""
    result = _lm_eval(dspark_server, tmp_path, task_yaml, "dspark_gsm8k_generate")
    assert result["exact_match,none"] == 0.0  # a random model; the run itself is the test


def test_lm_eval_loglikelihood(dspark_server, tmp_path):
    # Loglikelihood tasks send echo + logprobs on /v1/completions (prompt logprobs).
    probe = httpx.post(
        f"{dspark_server.base_url}/v1/completions",
        json={"model": SERVED_MODEL, "prompt": "a b", "max_tokens": 1, "echo": True, "logprobs": 1},
        timeout=60,
    )
    assert probe.status_code == 200, probe.text
    data = tmp_path / "choices.jsonl"
    with data.open("w") as f:
        for line in GSM8K.read_text().splitlines()[:20]:
            doc = json.loads(line)
            answer = doc["answer"].split("#### ")[-1]
            f.write(json.dumps({"question": doc["question"], "choices": [answer, "7", "12"]}))
            f.write("\n")
    task_yaml = f"""task: dspark_gsm8k_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
"""
    result = _lm_eval(dspark_server, tmp_path, task_yaml, "dspark_gsm8k_choice")
    assert 0.0 <= result["acc,none"] <= 1.0


OPENAI_SCRIPT = r"""
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
model = sys.argv[2]
out = {}
out["models"] = [m.id for m in client.models.list().data]
out["model"] = client.models.retrieve(model).id
c = client.completions.create(model=model, prompt="Hello", max_tokens=6, temperature=0,
                              extra_body={"lora_path": None, "min_tokens": 0})
out["completion"] = c.choices[0].text
tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
chat = client.chat.completions.create(
    model=model, max_tokens=6, temperature=0, tools=tools, tool_choice="auto",
    messages=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": None, "tool_calls": [{"id": "c1",
               "type": "function", "function": {"name": "get_weather",
               "arguments": "{\"city\": \"Paris\"}"}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
out["chat"] = chat.choices[0].message.content
stream = client.chat.completions.create(model=model, max_tokens=6, temperature=0, stream=True,
                                        messages=[{"role": "user", "content": "hi"}])
out["stream"] = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
print(json.dumps(out))
"""


def test_openai_client(dspark_server):
    out = run_client("-c", OPENAI_SCRIPT, dspark_server.base_url, SERVED_MODEL)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["models"] == [SERVED_MODEL] and result["model"] == SERVED_MODEL
    assert result["completion"] and result["chat"] is not None and result["stream"]
