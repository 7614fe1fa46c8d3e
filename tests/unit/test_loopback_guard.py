"""The loopback guard (support.loopback_guard): the /proc/net/tcp{,6} addresses it decodes and
which of them it finds off loopback. Its scans of real processes: tests/integration."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address

import pytest

from support.loopback_guard import off_loopback, parse_address

# Literal lines of an x86 (little-endian) machine: /proc prints each 32-bit word in host order.
TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:07E8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 298 1 0
   1: 0100007F:0CEA 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 301 1 0
   2: 0302017F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 302 1 0
   3: 0500000A:7530 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 303 1 0
   4: 020200C0:A44E 507100CB:01BB 01 00000000:00000000 02:0000051E 00000000     0        0 304 2 0
"""
TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:0CEA 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 401 1 0
   1: 0000000000000000FFFF00000100007F:0CEB 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 402 1 0
   2: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 403 1 0
   3: 0000000000000000FFFF00000500000A:1F91 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 404 1 0
   4: 000080FE00000000FF0000FC010000FE:1F92 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 405 1 0
"""  # noqa: E501


@pytest.mark.parametrize(
    ("field", "address", "port"),
    [
        ("00000000:07E8", IPv4Address("0.0.0.0"), 2024),
        ("0100007F:0CEA", IPv4Address("127.0.0.1"), 3306),
        ("0500000A:7530", IPv4Address("10.0.0.5"), 30000),
        ("00000000000000000000000001000000:0016", IPv6Address("::1"), 22),
        ("0000000000000000FFFF00000100007F:0016", IPv6Address("::ffff:127.0.0.1"), 22),
        ("00000000000000000000000000000000:0050", IPv6Address("::"), 80),
        ("000080FE00000000FF0000FC010000FE:0050", IPv6Address("fe80::fc00:ff:fe00:1"), 80),
    ],
)
def test_parse_address(field: str, address: IPv4Address | IPv6Address, port: int) -> None:
    assert parse_address(field, "little") == (address, port)


def test_parse_address_big_endian() -> None:
    assert parse_address("7F000001:0016", "big") == (IPv4Address("127.0.0.1"), 22)


def test_off_loopback_tcp() -> None:
    """0.0.0.0 and 10.0.0.5 are reported; 127.0.0.1, 127.1.2.3 and a connection are not."""
    assert off_loopback(TCP.splitlines(), "little") == {298: "0.0.0.0:2024", 303: "10.0.0.5:30000"}


def test_off_loopback_tcp6() -> None:
    """::, ::ffff:10.0.0.5 and a link-local address are reported; ::1 and ::ffff:127.0.0.1 not."""
    assert off_loopback(TCP6.splitlines(), "little") == {
        403: "[::]:8080",
        404: "[::ffff:a00:5]:8081",
        405: "[fe80::fc00:ff:fe00:1]:8082",
    }
