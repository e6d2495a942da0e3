//! Which addresses the notifier may call. A channel URL comes from the
//! platform team, but a name can resolve anywhere, so every address is
//! checked after resolution and the connection is pinned to the address
//! checked: loopback, link-local (169.254.0.0/16, where cloud metadata
//! services answer), private, shared and unique-local ranges and the
//! cluster's Service CIDRs are refused unless `--notify-allow-cidr` allows
//! them.

use std::net::IpAddr;

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
        let ip = canonical(ip);
        if self.allow.iter().any(|n| n.contains(&ip)) {
            return Ok(());
        }
        let why = if let Some(n) = self.services.iter().find(|n| n.contains(&ip)) {
            Some(format!("in the cluster's Service CIDR {n}"))
        } else {
            refused_range(ip).map(str::to_owned)
        };
        match why {
            None => Ok(()),
            Some(why) => Err(format!(
                "address {ip} is {why}; the operator does not call it unless --notify-allow-cidr allows it"
            )),
        }
    }
}

/// IPv4-mapped IPv6 addresses are judged as the IPv4 address they carry.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

fn refused_range(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => {
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
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            if v6.is_loopback() {
                Some("loopback")
            } else if v6.is_unspecified() {
                Some("unspecified")
            } else if (s[0] & 0xffc0) == 0xfe80 {
                Some("link-local")
            } else if (s[0] & 0xfe00) == 0xfc00 {
                Some("unique-local (private)")
            } else if v6.is_multicast() {
                Some("not a unicast address")
            } else {
                None
            }
        }
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
