"""Fine-tuning data on S3-compatible storage: `s3://bucket/key` read through fsspec's s3fs as `datasets`
reads it, the endpoint from data.s3_endpoint_url or AWS_ENDPOINT_URL, the credentials from the standard
AWS variables only, and never written to run.json or the logs.

The server is moto's S3 server (`python -m moto.server`, from PyPI's `moto[server]`), started by the test
in its own process on a loopback port. Real enough: it answers the S3 REST API over HTTP (SigV4-signed
requests, HEAD/GET with ranges, ListObjectsV2, ETags), so every byte goes through the same aiobotocore
client, signing and HTTP path as against AWS, R2 or MinIO; it is the server s3fs's own test suite runs
against. What it does not check is the signature itself (any key is accepted), so the tests check the
credentials' path by where they must not appear.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.finetune_harness import hf_cache, records_file, s3_server, tiny_model  # noqa: F401
from helpers.trainer_harness import finish, start_run

from trainer.configerror import ConfigError
from trainer.node.config import load_config
from trainer.node.hf.sources import data_fingerprint
from trainer.node.hf.training_data import build_training_data

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

BUCKET = "training-data"
CHATS = [
    {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                  {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]}
    for i in range(40)
]  # fmt: skip


@pytest.fixture(scope="module")
def bucket(s3_server, tmp_path_factory):  # noqa: F811
    """The chats as s3://training-data/chats.jsonl and as a save_to_disk directory under saved/, and
    the local file they were uploaded from."""
    local = tmp_path_factory.mktemp("s3-data")
    client = s3_server.client()
    client.create_bucket(Bucket=BUCKET)
    client.upload_file(records_file(local / "chats.jsonl", CHATS), BUCKET, "chats.jsonl")
    saved = local / "saved"
    records_file(saved, CHATS[:10])
    for file in sorted(saved.iterdir()):
        client.upload_file(str(file), BUCKET, f"saved/{file.name}")
    return local


@pytest.fixture
def credentials(s3_server, monkeypatch):  # noqa: F811
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)


def prepare(tiny_model, *sets: str):  # noqa: F811
    from transformers import AutoTokenizer

    config = load_config(None, [f"model.name_or_path={tiny_model}", "model.max_length=128", *sets])
    return build_training_data(config, AutoTokenizer.from_pretrained(tiny_model)), config


def test_s3_objects_give_the_samples_of_the_local_file(tiny_model, s3_server, bucket, credentials):  # noqa: F811
    endpoint = f"data.s3_endpoint_url={s3_server.endpoint}"
    remote, config = prepare(tiny_model, f"data.path=s3://{BUCKET}/chats.jsonl", endpoint)
    local, _ = prepare(tiny_model, f"data.path={bucket / 'chats.jsonl'}")
    assert (remote.facts["path"], remote.facts["format"]) == (f"s3://{BUCKET}/chats.jsonl", "messages")
    assert np.array_equal(remote.train.ids, local.train.ids)
    assert np.array_equal(remote.train.labels, local.train.labels)
    saved, _ = prepare(tiny_model, f"data.path=s3://{BUCKET}/saved", endpoint)
    assert np.array_equal(saved.train.ids, local.train.ids[: saved.train.offsets[-1]])
    assert len(saved.train) == 10
    # The fingerprint follows the object: rewritten, it changes.
    before = data_fingerprint(config)
    assert before == data_fingerprint(config) and before["sources"][0]["content"]["objects"] == 1
    s3_server.client().put_object(
        Bucket=BUCKET, Key="chats.jsonl", Body=(bucket / "chats.jsonl").read_bytes()[:-200]
    )
    try:
        assert data_fingerprint(config) != before
    finally:
        s3_server.client().upload_file(str(bucket / "chats.jsonl"), BUCKET, "chats.jsonl")


def test_s3_data_is_read_with_the_hub_offline(tiny_model, s3_server, bucket, credentials, monkeypatch):  # noqa: F811
    """HF_HUB_OFFLINE=1 (a cluster without the hub, a local model) governs the hub, not S3."""
    import datasets
    import huggingface_hub

    # What HF_HUB_OFFLINE=1 in a node's environment sets as the libraries load.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    endpoint = f"data.s3_endpoint_url={s3_server.endpoint}"
    remote, _ = prepare(tiny_model, f"data.path=s3://{BUCKET}/chats.jsonl", endpoint)
    saved, _ = prepare(tiny_model, f"data.path=s3://{BUCKET}/saved", endpoint)
    assert (len(remote.train), len(saved.train)) == (40, 10)
    assert datasets.config.HF_HUB_OFFLINE is True  # the hub's switch is as it was


def test_a_missing_object_is_named(tiny_model, s3_server, bucket, credentials):  # noqa: F811
    with pytest.raises(ConfigError) as missing:
        prepare(
            tiny_model, f"data.path=s3://{BUCKET}/nothing.jsonl", f"data.s3_endpoint_url={s3_server.endpoint}"
        )
    assert str(missing.value).startswith(
        f"data.path: cannot read s3://{BUCKET}/nothing.jsonl as json records:"
    )
    assert "FileNotFoundError" in str(missing.value)


@pytest.mark.slow
def test_a_run_on_s3_data_keeps_the_credentials_out_of_its_files(tiny_model, s3_server, bucket, tmp_path):  # noqa: F811
    """Two processes under torchrun train 4 steps on the s3 object, the endpoint from AWS_ENDPOINT_URL."""
    output = tmp_path / "run"
    env = {**s3_server.env, "AWS_ENDPOINT_URL": s3_server.endpoint}
    overrides = [
        f"model.name_or_path={tiny_model}",
        f"data.path=s3://{BUCKET}/chats.jsonl",
        "model.max_length=64",
        "train.max_steps=4",
        "train.log_every=2",
        "train.micro_batch_size=4",
        "checkpoint.save_steps=4",
    ]
    run = finish(start_run(output, overrides, env=env), output)
    assert run.returncode == 0, f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    facts = run.json("run.json")
    assert f"s3://{BUCKET}/chats.jsonl" in str(facts)
    assert f"data: s3://{BUCKET}/chats.jsonl: 40 messages records -> 40 samples" in run.stdout + run.stderr
    secrets = (s3_server.env["AWS_SECRET_ACCESS_KEY"], s3_server.env["AWS_ACCESS_KEY_ID"])
    written = [p for p in output.rglob("*") if p.is_file()]
    assert written
    for text, where in [(run.stdout, "stdout"), (run.stderr, "stderr")] + [
        (p.read_bytes().decode("utf-8", "replace"), str(p)) for p in written
    ]:
        for secret in secrets:
            assert secret not in text, f"{secret[:6]}… in {where}"
