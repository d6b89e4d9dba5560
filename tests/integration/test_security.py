"""TLS, mTLS and bearer-token auth on the public port, TLS between router and
executor over TCP, and the co-located socket's permissions. Certificates are
made in the test."""

from __future__ import annotations

import datetime
import os
import stat

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import free_port, start_server
from tests.integration.helpers import gen_request, stub


def _make_ca_and_certs(tmp):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def write(name, data):
        path = os.path.join(tmp, name)
        with open(path, "wb") as fh:
            fh.write(data)
        return path

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cbserve test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn, server):
        k = key()
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(ca_name)
            .public_key(k.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        if server:
            import ipaddress

            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        cert = b.sign(ca_key, hashes.SHA256())
        return (
            cert.public_bytes(serialization.Encoding.PEM),
            k.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        )

    s_cert, s_key = leaf("localhost", True)
    c_cert, c_key = leaf("client", False)
    return {
        "ca": write("ca.pem", ca.public_bytes(serialization.Encoding.PEM)),
        "server_cert": write("server.pem", s_cert),
        "server_key": write("server.key", s_key),
        "client_cert": write("client.pem", c_cert),
        "client_key": write("client.key", c_key),
    }


def _ssl_context(certs, client: bool):
    import ssl

    ctx = ssl.create_default_context(cafile=certs["ca"])
    if client:
        ctx.load_cert_chain(certs["client_cert"], certs["client_key"])
    return ctx


def _read(path):
    with open(path, "rb") as fh:
        return fh.read()


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return _make_ca_and_certs(str(tmp_path_factory.mktemp("certs")))


def _check_health(channel):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def test_tls_and_mtls_on_the_public_port(certs):
    good = grpc.ssl_channel_credentials(_read(certs["ca"]), _read(certs["client_key"]), _read(certs["client_cert"]))
    server = start_server(
        "tiny",
        config={
            "server": {
                "tls_cert_file": certs["server_cert"],
                "tls_key_file": certs["server_key"],
                "tls_client_ca_file": certs["ca"],
            }
        },
        credentials=good,
    )
    try:
        with server.channel() as ch:
            out = stub(ch).Complete(gen_request([5, 6, 7], max_new=3))
            assert len(out.token_ids) == 3
        no_client_cert = grpc.ssl_channel_credentials(_read(certs["ca"]))
        with grpc.secure_channel(server.address, no_client_cert) as ch:
            with pytest.raises(grpc.RpcError) as err:
                stub(ch).Complete(gen_request([5, 6, 7], max_new=3), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(server.address) as ch:  # plaintext is refused
            with pytest.raises(grpc.RpcError):
                stub(ch).Complete(gen_request([5, 6, 7], max_new=3), timeout=5)
        # The HTTP API on the same certificates: mTLS too.
        import httpx

        url = f"https://127.0.0.1:{server.http_port}"
        with httpx.Client(verify=_ssl_context(certs, client=True)) as http:
            assert http.get(f"{url}/health").status_code == 200
            assert http.get(f"{url}/v1/models").json()["data"]
        with pytest.raises(httpx.HTTPError), httpx.Client(verify=_ssl_context(certs, client=False)) as http:
            http.get(f"{url}/health")
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{server.http_port}/health", timeout=5)
    finally:
        server.stop()


def test_tls_without_client_certificates(certs):
    creds = grpc.ssl_channel_credentials(_read(certs["ca"]))
    server = start_server(
        "tiny",
        config={"server": {"tls_cert_file": certs["server_cert"], "tls_key_file": certs["server_key"]}},
        credentials=creds,
    )
    try:
        with server.channel() as ch:
            assert len(stub(ch).Complete(gen_request([5, 6, 7], max_new=2)).token_ids) == 2
    finally:
        server.stop()


def test_bearer_token_auth_keeps_health_open(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    server = start_server("tiny", config={"server": {"auth_token_file": str(token_file)}})
    try:
        with server.channel() as ch:
            s = stub(ch)
            assert _check_health(ch) == health_pb2.HealthCheckResponse.SERVING
            for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", "s3cret-token")]):
                for call in (
                    lambda md: s.Complete(gen_request([5], max_new=2), metadata=md),
                    lambda md: list(s.Generate(gen_request([5], max_new=2), metadata=md)),
                ):
                    with pytest.raises(grpc.RpcError) as err:
                        call(metadata)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            out = s.Complete(gen_request([5], max_new=2), metadata=[("authorization", "Bearer s3cret-token")])
            assert len(out.token_ids) == 2
        # The HTTP API takes the same token; /health stays open there too.
        import httpx

        base = f"http://127.0.0.1:{server.http_port}"
        assert httpx.get(f"{base}/health").status_code == 200
        body = {
            "model": httpx.get(f"{base}/v1/models", headers={"authorization": "Bearer s3cret-token"}).json()["data"][0][
                "id"
            ],
            "prompt": [5],
            "max_tokens": 2,
            "ignore_eos": True,  # a random tiny model may sample EOS first
        }
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret-token"}):
            r = httpx.post(f"{base}/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{base}/v1/models").status_code == 401
        ok = httpx.post(f"{base}/v1/completions", json=body, headers={"authorization": "Bearer s3cret-token"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        server.stop()


def test_token_from_environment_variable():
    server = start_server(
        "tiny", config={"server": {"auth_token_env": "CBSERVE_TEST_TOKEN"}}, env={"CBSERVE_TEST_TOKEN": "env-token"}
    )
    try:
        with server.channel() as ch:
            with pytest.raises(grpc.RpcError) as err:
                stub(ch).Complete(gen_request([5], max_new=1))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            out = stub(ch).Complete(gen_request([5], max_new=1), metadata=[("authorization", "Bearer env-token")])
            assert len(out.token_ids) == 1
    finally:
        server.stop()


def _tcp_executor_server(certs, port: int, **executor_cfg):
    """A server whose router reaches its executor over TLS on 127.0.0.1:port,
    with `executor_cfg` on top; it answered one request."""
    cfg = {"tls_cert_file": certs["server_cert"], "tls_key_file": certs["server_key"], "tls_ca_file": certs["ca"]}
    server = start_server(
        "tiny", config={"executor": {**cfg, **executor_cfg}}, extra_args=["--executor-address", f"127.0.0.1:{port}"]
    )
    with server.channel() as ch:
        assert len(stub(ch).Complete(gen_request([5, 6], max_new=3)).token_ids) == 3
    return server


def test_router_to_executor_over_tcp_with_tls(certs):
    port = free_port()
    server = _tcp_executor_server(certs, port)
    try:
        # The executor really speaks TLS: a plaintext client cannot use it.
        from cbserve.v1 import executor_pb2, executor_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError):
                executor_pb2_grpc.ExecutorStub(ch).Describe(executor_pb2.DescribeRequest(), timeout=3)
    finally:
        server.stop()


def test_router_to_executor_over_mtls_admits_only_the_router(certs):
    port = free_port()
    server = _tcp_executor_server(
        certs,
        port,
        tls_client_cert_file=certs["client_cert"],
        tls_client_key_file=certs["client_key"],
        tls_client_ca_file=certs["ca"],
    )
    try:
        # A TLS client that trusts the executor but has no certificate is turned away.
        from cbserve.v1 import executor_pb2, executor_pb2_grpc

        creds = grpc.ssl_channel_credentials(root_certificates=_read(certs["ca"]))
        with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:
            with pytest.raises(grpc.RpcError):
                executor_pb2_grpc.ExecutorStub(ch).Describe(executor_pb2.DescribeRequest(), timeout=3)
    finally:
        server.stop()


def test_colocated_executor_socket_is_private(tiny_server):
    import psutil

    cmd = psutil.Process(tiny_server.executor_pid()).cmdline()
    listen = cmd[cmd.index("--listen") + 1]
    path = listen.removeprefix("unix://")
    mode = stat.S_IMODE(os.stat(path).st_mode)
    assert mode & 0o077 == 0, oct(mode)


def test_tenants_never_share_prefix_cache_blocks_and_are_counted_apart(tmp_path):
    import httpx
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    tokens = tmp_path / "tokens"
    tokens.write_text("# tenant token\nteam-a tok-a\nteam-b tok-b\n")
    server = start_server("tiny", config={"server": {"auth_tokens_file": str(tokens), "enable_reflection": False}})
    prompt = list(range(5, 45))  # two full 16-token blocks and a partial one

    def cached(token):
        # With auth on, the gateway's tenant header names no tenant: a client
        # cannot speak for another (here team-a's calls claim team-b).
        spoof = ("x-gateway-inference-fairness-id", "team-b")
        with server.channel() as ch:
            out = stub(ch).Complete(
                gen_request(prompt, max_new=2), metadata=[("authorization", f"Bearer {token}"), spoof]
            )
        return out.usage.cached_prompt_tokens

    try:
        assert cached("tok-a") == 0
        assert cached("tok-a") == 32  # its own blocks
        assert cached("tok-b") == 0  # the same prompt, another tenant: no hit
        assert cached("tok-b") == 32
        with server.channel() as ch:
            with pytest.raises(grpc.RpcError) as err:
                stub(ch).Complete(gen_request(prompt, max_new=2), metadata=[("authorization", "Bearer tok-c")])
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _check_health(ch) == health_pb2.HealthCheckResponse.SERVING  # health stays open
            with pytest.raises(grpc.RpcError) as err:  # reflection turned off
                list(
                    reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
                    )
                )
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        base = f"http://127.0.0.1:{server.http_port}"
        model = httpx.get(f"{base}/v1/models", headers={"authorization": "Bearer tok-b"}).json()["data"][0]["id"]
        r = httpx.post(
            f"{base}/v1/completions",
            # ignore_eos: sampled at temperature 1, the counts below need both tokens
            json={"model": model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True, "user": "team-a"},
            headers={"authorization": "Bearer tok-b", "x-gateway-inference-fairness-id": "team-a"},
        )
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        m = server.metrics()
        assert m["cbserve_tenant_requests_total{status=OK,tenant=team-a}"] == 2
        assert m["cbserve_tenant_requests_total{status=OK,tenant=team-b}"] == 3
        assert m["cbserve_tenant_service_tokens_total{kind=output,tenant=team-b}"] == 3 * 2
        assert '"tenant": "team-b"' in server.log() or "tenant=team-b" in server.log()
    finally:
        server.stop()


def test_a_bad_tokens_file_stops_serve_with_the_reason(tmp_path):
    import yaml

    from tests.integration.helpers import run_serve

    tokens = tmp_path / "tokens"
    tokens.write_text("just-one-field\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"server": {"auth_tokens_file": str(tokens)}}))
    out = run_serve("--config", str(cfg))
    assert out.returncode == 2 and "expected 'TENANT TOKEN'" in out.stderr, out.stderr[-2000:]
