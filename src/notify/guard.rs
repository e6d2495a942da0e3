//! Which addresses the notifier may call. A channel URL comes from the
//! platform team, but a name can resolve anywhere, so every address is
//! checked after resolution and the connection is pinned to the address
//! checked: loopback, link-local (169.254.0.0/16, where cloud metadata
//! services answer), private, shared and unique-local ranges and the
//! cluster's Service CIDRs are refused unless `--notify-allow-cidr` allows
//! them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// The address policy.
#[derive(Clone, Debug, Default)]
pub struct Guard {
    /// Ranges allowed although they would be refused (`--notify-allow-cidr`).
    pub allow: Vec<IpNet>,
    /// The cluster's Service CIDRs (from the ServiceCIDR API, when readable).
    pub services: Vec<IpNet>,
}

impl Guard {
    /// `Ok` when `ip` may be called; otherwise why not, for the Approval's
    /// condition.
    pub fn check(&self, ip: IpAddr) -> Result<(), String> {
        // An address that reaches an IPv4 host is also judged as that host
        // (allowed or in a Service CIDR by either form).
        let reaches = match ip {
            IpAddr::V6(v6) => match embedded(v6) {
                Embedded::Reaches(v4) => Some(IpAddr::V4(v4)),
                _ => None,
            },
            IpAddr::V4(_) => None,
        };
        let forms = || std::iter::once(ip).chain(reaches);
        if self.allow.iter().any(|n| forms().any(|a| n.contains(&a))) {
            return Ok(());
        }
        let why = if let Some(n) = self
            .services
            .iter()
            .find(|n| forms().any(|a| n.contains(&a)))
        {
            Some(format!("in the cluster's Service CIDR {n}"))
        } else {
            refused_range(ip)
        };
        match why {
            None => Ok(()),
            Some(why) => Err(format!(
                "address {ip} is {why}; the operator does not call it unless --notify-allow-cidr allows it"
            )),
        }
    }
}

/// What an IPv6 address says about the IPv4 host it reaches, if anything.
#[derive(Debug, PartialEq, Eq)]
enum Embedded {
    /// Not an IPv4 transition form: judged as IPv6.
    None,
    /// A form whose packets reach this IPv4 host (IPv4-mapped, NAT64): judged
    /// as that host.
    Reaches(Ipv4Addr),
    /// A tunnel or deprecated form (IPv4-compatible `::/96`, 6to4, Teredo):
    /// where it leads depends on relays the guard cannot see, so it is
    /// refused whatever IPv4 address it carries.
    Tunnel(&'static str),
}

fn embedded(v6: Ipv6Addr) -> Embedded {
    let s = v6.segments();
    let low = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    if let Some(v4) = v6.to_ipv4_mapped() {
        Embedded::Reaches(v4)
    } else if s[..5] == [0; 5] && s[5] == 0 && !(v6.is_loopback() || v6.is_unspecified()) {
        Embedded::Tunnel("IPv4-compatible (::/96, deprecated)")
    } else if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        // NAT64 (RFC 6052): the translator connects to the IPv4 host in the
        // low 32 bits; an IPv6-only cluster reaches public hosts this way.
        Embedded::Reaches(low)
    } else if s[0] == 0x64 && s[1] == 0xff9b && s[2] == 1 {
        Embedded::Tunnel("local-use NAT64 (64:ff9b:1::/48)")
    } else if s[0] == 0x2002 {
        Embedded::Tunnel("6to4 (2002::/16)")
    } else if s[0] == 0x2001 && s[1] == 0 {
        Embedded::Tunnel("Teredo (2001::/32)")
    } else {
        Embedded::None
    }
}

fn refused_range(ip: IpAddr) -> Option<String> {
    match ip {
        IpAddr::V4(v4) => refused_v4(v4).map(str::to_owned),
        IpAddr::V6(v6) => match embedded(v6) {
            Embedded::Reaches(v4) => refused_v4(v4).map(|why| format!("{why} (IPv4 {v4})")),
            Embedded::Tunnel(form) => Some(format!(
                "{form}, a tunnel to an IPv4 host the guard cannot check"
            )),
            Embedded::None => refused_v6(v6).map(str::to_owned),
        },
    }
}

fn refused_v4(v4: Ipv4Addr) -> Option<&'static str> {
    let o = v4.octets();
    if v4.is_loopback() {
        Some("loopback")
    } else if v4.is_link_local() {
        Some("link-local (cloud metadata services answer there)")
    } else if v4.is_private() {
        Some("private")
    } else if o[0] == 100 && (64..128).contains(&o[1]) {
        Some("in the shared address space 100.64.0.0/10")
    } else if v4.is_unspecified() || o[0] == 0 {
        Some("unspecified")
    } else if v4.is_broadcast() || v4.is_multicast() || o[0] >= 240 {
        Some("not a unicast address")
    } else if o[0] == 192 && o[1] == 0 && o[2] == 0 {
        Some("in the IETF protocol range 192.0.0.0/24")
    } else if o[0] == 198 && (o[1] & 0xfe) == 18 {
        Some("in the benchmarking range 198.18.0.0/15")
    } else {
        None
    }
}

fn refused_v6(v6: Ipv6Addr) -> Option<&'static str> {
    let s = v6.segments();
    if v6.is_loopback() {
        Some("loopback")
    } else if v6.is_unspecified() {
        Some("unspecified")
    } else if (s[0] & 0xffc0) == 0xfe80 {
        Some("link-local")
    } else if (s[0] & 0xffc0) == 0xfec0 {
        Some("site-local (private, deprecated)")
    } else if (s[0] & 0xfe00) == 0xfc00 {
        Some("unique-local (private)")
    } else if v6.is_multicast() {
        Some("not a unicast address")
    } else if s[0] == 0x100 && s[1..4] == [0; 3] {
        Some("in the discard range 100::/64")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn internal_addresses_are_refused_and_public_ones_allowed() {
        let g = Guard::default();
        for (addr, why) in [
            ("127.0.0.1", "loopback"),
            ("169.254.169.254", "link-local"),
            ("10.1.2.3", "private"),
            ("172.16.0.1", "private"),
            ("192.168.1.1", "private"),
            ("100.64.0.1", "shared address space"),
            ("0.0.0.0", "unspecified"),
            ("::1", "loopback"),
            ("fe80::1", "link-local"),
            ("fd00::1", "unique-local"),
            ("::ffff:127.0.0.1", "loopback"),
            ("::ffff:169.254.169.254", "link-local"),
        ] {
            let err = g.check(ip(addr)).unwrap_err();
            assert!(err.contains(why), "{addr}: {err}");
        }
        for addr in ["93.184.216.34", "2606:2800:220:1::1", "8.8.8.8"] {
            assert_eq!(g.check(ip(addr)), Ok(()), "{addr}");
        }
    }

    #[test]
    fn every_ipv6_form_of_an_internal_ipv4_host_is_refused() {
        let g = Guard::default();
        for (addr, why) in [
            // IPv4-compatible (::/96): refused whatever it carries.
            ("::127.0.0.1", "IPv4-compatible (::/96"),
            ("::8.8.8.8", "IPv4-compatible (::/96"),
            ("::169.254.169.254", "IPv4-compatible (::/96"),
            // IPv4-mapped: the IPv4 host it reaches.
            ("::ffff:10.0.0.1", "private (IPv4 10.0.0.1)"),
            // NAT64: the translator connects to the IPv4 host.
            ("64:ff9b::127.0.0.1", "loopback (IPv4 127.0.0.1)"),
            (
                "64:ff9b::a9fe:a9fe",
                "link-local (cloud metadata services answer there) (IPv4 169.254.169.254)",
            ),
            ("64:ff9b::10.1.2.3", "private (IPv4 10.1.2.3)"),
            ("64:ff9b:1::a00:1", "local-use NAT64"),
            // 6to4 and Teredo: tunnels through relays nobody checks.
            ("2002:7f00:1::1", "6to4 (2002::/16)"),
            ("2002:808:808::1", "6to4 (2002::/16)"),
            ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo (2001::/32)"),
            // Other internal IPv6 and IPv4 ranges.
            ("fec0::1", "site-local"),
            ("100::1", "discard range"),
            ("192.0.0.8", "IETF protocol range"),
            ("198.18.0.1", "benchmarking range"),
        ] {
            let err = g.check(ip(addr)).unwrap_err();
            assert!(err.contains(why), "{addr}: {err}");
        }
        // NAT64 to a public host is how an IPv6-only cluster reaches the
        // Internet; a global IPv6 address near a transition prefix is not one.
        for addr in [
            "64:ff9b::808:808",
            "2001:4860:4860::8888",
            "2003::1",
            "2606:4700::1111",
        ] {
            assert_eq!(g.check(ip(addr)), Ok(()), "{addr}");
        }
    }

    #[test]
    fn an_allowed_or_service_range_covers_the_ipv6_forms_of_its_hosts() {
        let g = Guard {
            allow: vec!["10.9.0.0/16".parse().unwrap()],
            services: vec!["10.96.0.0/12".parse().unwrap()],
        };
        assert_eq!(g.check(ip("64:ff9b::10.9.1.1")), Ok(()));
        assert_eq!(g.check(ip("::ffff:10.9.1.1")), Ok(()));
        let err = g.check(ip("::ffff:10.96.0.1")).unwrap_err();
        assert!(err.contains("Service CIDR 10.96.0.0/12"), "{err}");
        // A tunnel form is not the host it carries: not allowed by the IPv4 range.
        assert!(g.check(ip("::10.9.1.1")).is_err());
    }

    #[test]
    fn an_allowed_range_is_called_and_the_service_cidr_is_refused() {
        let g = Guard {
            allow: vec!["127.0.0.1/32".parse().unwrap()],
            services: vec!["34.118.224.0/20".parse().unwrap()],
        };
        assert_eq!(g.check(ip("127.0.0.1")), Ok(()));
        assert!(g.check(ip("127.0.0.2")).is_err());
        let err = g.check(ip("34.118.230.1")).unwrap_err();
        assert!(err.contains("Service CIDR 34.118.224.0/20"), "{err}");
    }
}
