"""``perseus_client`` picks its transport from the environment: the injected TCP address first,
then the mounted socket's path, then the default path."""

from __future__ import annotations

import pytest

from perseus_client import protocol, transport
from perseus_client.client import PerseusClient


def test_the_injected_tcp_address_wins_over_the_socket_path() -> None:
    env = {transport.ADDRESS_ENV: "tcp://10.0.0.5:7460", protocol.SOCKET_ENV: "/x/agent.sock"}
    address = transport.address_from_env(env)
    assert (address.host_or_path, address.port, address.is_tcp) == ("10.0.0.5", 7460, True)
    assert str(address) == "tcp://10.0.0.5:7460"


@pytest.mark.parametrize(
    ("env", "path"),
    [
        ({protocol.SOCKET_ENV: "/x/agent.sock"}, "/x/agent.sock"),
        ({}, protocol.DEFAULT_SOCKET_PATH),
        ({transport.ADDRESS_ENV: "unix:///y/agent.sock"}, "/y/agent.sock"),
    ],
)
def test_without_a_tcp_address_the_unix_socket_is_used(env: dict[str, str], path: str) -> None:
    address = transport.address_from_env(env)
    assert (address.host_or_path, address.port) == (path, None)


def test_ipv6_addresses_are_bracketed() -> None:
    address = transport.parse_address("tcp://[fd00::5]:7460")
    assert (address.host_or_path, address.port) == ("fd00::5", 7460)
    assert str(address) == "tcp://[fd00::5]:7460"


@pytest.mark.parametrize(
    "text",
    [
        "tcp://$(PERSEUS_HOST_IP):7460x",
        "tcp://10.0.0.5",
        "tcp://:7460",
        "http://a:1",
        "unix://",
        "",
    ],
)
def test_a_malformed_address_says_what_is_expected(text: str) -> None:
    with pytest.raises(transport.AddressError, match="agent address"):
        transport.parse_address(text)


def test_the_client_reads_the_address_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(transport.ADDRESS_ENV, "tcp://127.0.0.1:9")
    client = PerseusClient()
    try:
        assert client.address.port == 9 and client.socket_path == "tcp://127.0.0.1:9"
    finally:
        client.close()
