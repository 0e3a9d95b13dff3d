"""/v1/files and /v1/batches driven by the official `openai` client over real HTTP.

files.create + batches.create + batches.retrieve (polled through the API's own status, with
a deadline) + files.content, against the same requests sent one by one to
/v1/chat/completions and /v1/completions (greedy): each batch result equals its one-by-one
reply. Bad lines fail the batch with their line numbers; a cancel ends in "cancelled"; a
server restarted over the same files folder finishes a batch the previous one left.
"""

from __future__ import annotations

import json
import time

import openai
import pytest

from tests.server_helpers import TIMEOUT_S, openai_client, running_engine, running_server

pytestmark = pytest.mark.model

TERMINAL = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def engine():
    with running_engine() as eng:
        yield eng


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("api-files")


@pytest.fixture(scope="module")
def server(engine, files_dir):
    with running_server(engine, files_dir=files_dir) as thread:
        yield thread


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


def chat_body(i: int) -> dict:
    return {"model": "default", "temperature": 0, "max_tokens": 12 + i % 5,
            "messages": [{"role": "user", "content": f"Give me one fact about the number {i}."}]}


def completion_body(i: int) -> dict:
    return {"model": "default", "temperature": 0, "max_tokens": 10,
            "prompt": f"Item {i} on my shopping list is"}


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def comparable(body: dict) -> dict:
    """A response body without what differs between two runs of one request: its id, its
    time and how much of its prompt the prefix cache held."""
    body = json.loads(json.dumps(body))
    body.pop("id"), body.pop("created")
    body["usage"].pop("prompt_tokens_details", None)
    return body


def wait_for(client: openai.OpenAI, batch_id: str, timeout: float = TIMEOUT_S):
    """Poll the batch's status through the API until it ends (a deadline, no fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in TERMINAL:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status} after {timeout}s"
        time.sleep(0.05)


def run_batch(client: openai.OpenAI, rows: list[dict], endpoint: str):
    uploaded = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(rows))
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint,
                                  completion_window="24h", metadata={"job": "test"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "test"}
    return wait_for(client, batch.id)


def results(client: openai.OpenAI, file_id: str) -> dict[str, dict]:
    text = client.files.content(file_id).text
    records = [json.loads(r) for r in text.splitlines()]
    return {r["custom_id"]: r for r in records}


def test_chat_batch_equals_the_same_requests_one_by_one(client) -> None:
    rows = [line(f"chat-{i}", "/v1/chat/completions", chat_body(i)) for i in range(12)]
    batch = run_batch(client, rows, "/v1/chat/completions")
    assert batch.status == "completed", batch.errors
    assert batch.request_counts.total == 12 and batch.request_counts.completed == 12
    assert batch.request_counts.failed == 0 and batch.error_file_id is None
    got = results(client, batch.output_file_id)
    assert sorted(got) == sorted(r["custom_id"] for r in rows)
    for row in rows:
        record = got[row["custom_id"]]
        assert record["response"]["status_code"] == 200 and record["error"] is None
        alone = client.chat.completions.create(**row["body"]).model_dump(exclude_unset=True)
        assert comparable(record["response"]["body"]) == comparable(alone)


def test_completions_batch_with_a_failing_line_splits_output_and_errors(client) -> None:
    rows = [line(f"text-{i}", "/v1/completions", completion_body(i)) for i in range(6)]
    # valid JSON but too long for the context: fails when it runs (400), as OpenAI's would
    rows.append(line("too-long", "/v1/completions",
                     {"prompt": list(range(1, 9000)), "max_tokens": 4}))
    batch = run_batch(client, rows, "/v1/completions")
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (6, 1)
    got = results(client, batch.output_file_id)
    for row in rows[:6]:
        alone = client.completions.create(**row["body"]).model_dump(exclude_unset=True)
        assert comparable(got[row["custom_id"]]["response"]["body"]) == comparable(alone)
    errors = results(client, batch.error_file_id)
    failed = errors["too-long"]["response"]
    assert failed["status_code"] == 400
    assert failed["body"]["error"]["code"] == "context_length_exceeded"


def test_bad_lines_fail_the_batch_with_their_numbers(client) -> None:
    rows = [line("ok", "/v1/chat/completions", chat_body(1)),
            line("wrong-url", "/v1/completions", completion_body(2)),
            line("bad-temp", "/v1/chat/completions", {**chat_body(3), "temperature": "hot"})]
    batch = run_batch(client, rows, "/v1/chat/completions")
    assert batch.status == "failed" and batch.output_file_id is None
    assert [(e.line, "url" in e.message) for e in batch.errors.data] == [(2, True), (3, False)]
    assert "temperature" in batch.errors.data[1].message


def test_cancel_ends_a_running_batch(client) -> None:
    rows = [line(f"long-{i}", "/v1/completions",
                 {"prompt": f"Story number {i}:", "max_tokens": 200, "temperature": 0})
            for i in range(40)]
    uploaded = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                                  completion_window="24h")
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status in ("cancelling", "cancelled")
    final = wait_for(client, batch.id)
    assert final.status == "cancelled"
    assert final.request_counts.completed < 40
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    with pytest.raises(openai.APIStatusError) as info:
        client.batches.cancel(batch.id)
    assert info.value.status_code == 409


def test_files_list_retrieve_delete_and_errors(client) -> None:
    uploaded = client.files.create(file=("notes.jsonl", b"{}\n"), purpose="batch")
    assert client.files.retrieve(uploaded.id).filename == "notes.jsonl"
    assert uploaded.id in [f.id for f in client.files.list(purpose="batch").data]
    assert client.files.content(uploaded.id).content == b"{}\n"
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions",
                              completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="nonsense")  # type: ignore[arg-type]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).files.list()


def test_a_restarted_server_finishes_a_batch_left_in_progress(engine, client, files_dir) -> None:
    """The batch's record and its results are on disk: a server started over the same
    folder goes on with it, computing only the lines the first did not finish."""
    rows = [line(f"again-{i}", "/v1/completions", completion_body(i)) for i in range(4)]
    first = run_batch(client, rows, "/v1/completions")
    done = results(client, first.output_file_id)
    # the state a stop in the middle leaves: in progress, two of four results on disk
    record_path = files_dir / "batches" / f"{first.id}.json"
    record = json.loads(record_path.read_text())
    record.update(status="in_progress", output_file_id=None, completed_at=None)
    left = {**record, "id": "batch_" + "0" * 32}
    (files_dir / "batches" / f"{left['id']}.json").write_text(json.dumps(left))
    kept = [done[f"again-{i}"] for i in (0, 2)]
    (files_dir / "batches" / f"{left['id']}.results.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in kept))
    with running_server(engine, files_dir=files_dir) as second:
        other = openai_client(second)
        finished = wait_for(other, left["id"])
        assert finished.status == "completed"
        got = results(other, finished.output_file_id)
        assert sorted(got) == [f"again-{i}" for i in range(4)]
        for i in (0, 2):  # kept as they were: the same record ids, not computed again
            assert got[f"again-{i}"]["id"] == done[f"again-{i}"]["id"]
        for i in (1, 3):  # computed by the second server: equal, under new record ids
            assert got[f"again-{i}"]["id"] != done[f"again-{i}"]["id"]
            assert comparable(got[f"again-{i}"]["response"]["body"]) == comparable(
                done[f"again-{i}"]["response"]["body"])
