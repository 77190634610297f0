"""Credentials never reach saved configs; the local record survives a torn last line."""
from rlmm.run.logging import redact
from rlmm.run.records import RunRecord, read_steps


def test_redact_hides_credentials_only():
    config = {"logger": {"api_key": "k", "WANDB_API_KEY": "k", "hf_token": "t", "password": "p"},
              "sampling": {"max_new_tokens": 8, "token_budget": 3}, "secret": "s"}
    out = redact(config)
    assert out["logger"] == {k: "<redacted>" for k in config["logger"]}
    assert out["secret"] == "<redacted>"
    assert out["sampling"] == {"max_new_tokens": 8, "token_budget": 3}


def test_record_is_readable_after_a_torn_line(tmp_path):
    record = RunRecord(tmp_path, {"seed": 0, "logger": {"api_key": "k"}})
    record.log({"loss/loss": 1.0, "nan": float("nan")}, step=0)
    record.log({"loss/loss": 0.5}, step=1)
    record.close()
    with open(tmp_path / "steps.jsonl", "a") as f:
        f.write('{"step": 2, "loss/lo')  # a job killed mid-write
    assert [r["step"] for r in read_steps(tmp_path)] == [0, 1]
    assert read_steps(tmp_path)[0]["nan"] is None
    assert "api_key: <redacted>" in (tmp_path / "config.yaml").read_text()
