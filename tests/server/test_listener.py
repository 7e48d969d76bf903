"""The HTTP settings: which Host headers pass, where the API key comes from, what the serve options become."""

import pytest

from lockstep.cli import build_parser, http_config
from lockstep.server.connection import DROPPED, REFUSED, SERVED, ConnectionLedger
from lockstep.server.listener import HTTPConfig, allowed_hosts_for, read_api_key
from lockstep.server.metrics import Metrics


def test_a_loopback_server_accepts_only_loopback_host_names() -> None:
    for bind in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        cfg = HTTPConfig(allowed_hosts=allowed_hosts_for(bind))
        for host in (b"localhost", b"localhost:8000", b"127.0.0.1:8000", b"[::1]:8000", b"::1", b"LocalHost.:1"):
            assert cfg.host_allowed(host), (bind, host)
        for host in (b"evil.example", b"evil.example:8000", b"localhost.evil.example", b"127.0.0.1.nip.io", b"", None):
            assert not cfg.host_allowed(host), (bind, host)
    assert HTTPConfig(allowed_hosts=allowed_hosts_for("127.0.0.2")).host_allowed(b"127.0.0.2:80")


def test_other_binds_accept_any_host_unless_told() -> None:
    assert allowed_hosts_for("0.0.0.0") is None and allowed_hosts_for("10.1.2.3") is None
    assert HTTPConfig(allowed_hosts=None).host_allowed(b"anything.example")
    named = HTTPConfig(allowed_hosts=allowed_hosts_for("0.0.0.0", "api.example, [::1] ,Other.Example."))
    assert named.allowed_hosts == ("api.example", "::1", "other.example")
    assert named.host_allowed(b"api.example:443") and named.host_allowed(b"[::1]:1")
    assert not named.host_allowed(b"localhost")
    assert allowed_hosts_for("127.0.0.1", "*") is None
    with pytest.raises(ValueError, match="empty"):
        allowed_hosts_for("127.0.0.1", " , ")


def test_api_key_from_flag_file_or_environment(tmp_path) -> None:
    env = {"LOCKSTEP_API_KEY": "from-env"}
    assert read_api_key(None, None, {}) is None
    assert read_api_key(None, None, env) == "from-env"
    assert read_api_key("from-flag", None, env) == "from-flag"
    key_file = tmp_path / "key"
    key_file.write_text("  from-file  \nsecond line\n")
    assert read_api_key(None, str(key_file), env) == "from-file"
    with pytest.raises(ValueError, match="not both"):
        read_api_key("a", str(key_file), env)
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_api_key(None, str(key_file), env)
    with pytest.raises(FileNotFoundError):
        read_api_key(None, str(tmp_path / "missing"), env)


def test_serve_options_become_the_http_config(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("LOCKSTEP_API_KEY", raising=False)
    (tmp_path / "key").write_text("k1\n")
    args = build_parser().parse_args(
        ["serve", "--api-key-file", str(tmp_path / "key"), "--max-connections", "7", "--header-timeout", "2.5"]
        + ["--body-timeout", "9", "--max-body-bytes", "1000"]
    )
    cfg = http_config(args)
    assert (cfg.api_key, cfg.max_connections, cfg.header_timeout, cfg.body_timeout) == ("k1", 7, 2.5, 9.0)
    assert cfg.max_body_bytes == 1000 and cfg.allowed_hosts == ("localhost", "127.0.0.1", "::1")
    assert cfg.max_connections_per_client == 3 and cfg.body_idle_timeout == 10.0  # half the cap; the default
    default = http_config(build_parser().parse_args(["serve", "--host", "0.0.0.0"]))
    assert default.api_key is None and default.allowed_hosts is None and default.max_connections == 1024
    assert default.max_connections_per_client == 512 and default.max_header_bytes == 16384
    given = ["serve", "--max-connections-per-client", "40", "--body-idle-timeout", "2"]
    cfg = http_config(build_parser().parse_args(given))
    assert (cfg.max_connections_per_client, cfg.body_idle_timeout) == (40, 2.0)
    monkeypatch.setenv("LOCKSTEP_API_KEY", "k2")
    assert http_config(build_parser().parse_args(["serve"])).api_key == "k2"
    bad_options = [["--max-connections", "0"], ["--body-timeout", "-1"], ["--api-key", ""]]
    bad_options += [["--max-connections-per-client", "0"], ["--body-idle-timeout", "0"]]
    for bad in bad_options:
        with pytest.raises(ValueError):
            http_config(build_parser().parse_args(["serve", *bad]))


def test_the_bound_socket_serves_with_tcp_nodelay() -> None:
    # asyncio sets TCP_NODELAY only on sockets that say TCP; a socket made with proto 0 served every small reply
    # ~40 ms late (Nagle's algorithm against delayed ACKs): /health's median went from 6 ms to 52 ms.
    import asyncio
    import socket

    from lockstep.server.listener import bind_socket

    async def nodelay_of_an_accepted_connection() -> int:
        seen = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=bind_socket("127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        value = await asyncio.wait_for(seen, 10)
        writer.close()
        server.close()
        return value

    assert asyncio.run(nodelay_of_an_accepted_connection()) != 0
    with pytest.raises(ValueError, match="already in use"), socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        bind_socket("127.0.0.1", busy.getsockname()[1])


def test_the_ledger_counts_connections_when_accepted_by_client() -> None:
    metrics = Metrics()
    assert ConnectionLedger(16, 8).max_refused == 64 and ConnectionLedger(1024, 512).max_refused == 128
    ledger = ConnectionLedger(max_connections=8, max_per_client=3, metrics=metrics, max_refused=8)
    assert [ledger.admit("a") for _ in range(4)] == [SERVED] * 3 + [REFUSED]  # a's fourth is past its limit
    assert [ledger.admit(f"c{i}") for i in range(6)] == [SERVED] * 5 + [REFUSED]  # the cap: 8 served in all
    assert [ledger.admit("d") for _ in range(7)] == [REFUSED] * 6 + [DROPPED]  # 8 refused ones open at most
    assert (metrics.connections_open, metrics.connections_refused) == (8, 9)
    ledger.release("a", SERVED)
    ledger.release("d", REFUSED)
    ledger.release("d", DROPPED)
    assert ledger.admit("a") is SERVED and ledger.admit("e") is REFUSED
    assert ledger.by_client["a"] == 3 and metrics.connections_open == 8 and ledger.refused_open == 8
