"""`spindle serve` with an API key file and TLS on the public ports: real completions over https and
grpcs with the key, 401 / UNAUTHENTICATED without it, health open to probes."""

from __future__ import annotations

import hashlib
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer

from shared.pb.spindle.v1 import generation_pb2_grpc
from tests.e2e.clients import grpc_generate
from tests.e2e.oracle import greedy_tokens
from tests.e2e.server import spindle_serve
from tests.shared.certificates import CertificateAuthority

pytestmark = pytest.mark.e2e

KEY = "sk-e2e-secret"
PROMPT = [0, 306, 458, 278, 193, 310, 284]


def _post(url: str, body: object, context: ssl.SSLContext, key: str | None) -> tuple[int, dict]:
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60, context=context) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


async def test_serve_with_api_key_and_tls_completes_over_https_and_grpcs(tiny_models: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    model = tiny_models["llama"]
    ca = CertificateAuthority.create(tmp_path / "pki")
    cert_file, key_file = ca.issue("spindle")
    keys = tmp_path / "api-keys"
    # Stored hashed: the file need not hold the key itself.
    keys.write_text(f"# e2e\nsha256:{hashlib.sha256(KEY.encode()).hexdigest()}\n")
    want = greedy_tokens(model, PROMPT, 8)
    trusting = ssl.create_default_context(cafile=str(ca.ca_file))
    with spindle_serve(model, "--tls-cert-file", str(cert_file), "--tls-key-file", str(key_file),
                       "--api-key-file", str(keys), scheme="https") as server:
        assert server.http_url.startswith("https://")
        with urllib.request.urlopen(server.http_url + "/health", timeout=10, context=trusting) as resp:
            assert resp.status == 200  # probes need no key
        body = {"model": server.model_name, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        status, answer = _post(server.http_url + "/v1/completions", body, trusting, key=None)
        assert status == 401 and answer["error"]["code"] == "invalid_api_key"
        status, answer = _post(server.http_url + "/v1/completions", body, trusting, key=KEY)
        assert status == 200, answer
        tokenizer = AutoTokenizer.from_pretrained(model)
        assert answer["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)

        credentials = grpc.ssl_channel_credentials(root_certificates=ca.ca_file.read_bytes())
        async with grpc.aio.secure_channel(server.grpc_address, credentials) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await grpc_generate(stub, server.model_name, PROMPT, 8)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call_credentials = grpc.access_token_call_credentials(KEY)  # sends `authorization: Bearer <key>`
            keyed = grpc.composite_channel_credentials(credentials, call_credentials)
        async with grpc.aio.secure_channel(server.grpc_address, keyed) as channel:
            got = await grpc_generate(generation_pb2_grpc.GenerationServiceStub(channel), server.model_name,
                                      PROMPT, 8)
        assert got.token_ids == want
