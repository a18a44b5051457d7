//! Pod IPs on the real node's network: each running pod's `status.podIP` is added (as a
//! host route, /32 or /128) to an interface the runner owns in that namespace, so that
//! a container can bind to its pod IP and the Service rules kube-proxy programs there
//! reach it. Several pods may share an IP (host-network pods get their node's), so
//! addresses are counted and removed with their last user.
//!
//! The interface is a bridge without ports, not the `dummy` device one would expect:
//! the fleet's kernels are built without the dummy driver, and a port-less bridge
//! holds local addresses just as well.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::process::Command;
use std::sync::Mutex;

use crate::{Error, IoContext, Result};

/// The runner's interface in the real node's network namespace.
#[derive(Debug)]
pub(super) struct Addresses {
    netns: String,
    interface: String,
    users: Mutex<Users>,
}

impl Addresses {
    /// Creates the interface if missing and drops any address on it (left by a runner
    /// that did not stop cleanly: none of its pods runs any more).
    pub(super) fn create(netns: &str, interface: &str) -> Result<Self> {
        let addresses = Self {
            netns: netns.to_owned(),
            interface: interface.to_owned(),
            users: Mutex::default(),
        };
        if addresses.ip(&["link", "show", interface]).is_err() {
            addresses.ip(&["link", "add", interface, "type", "bridge"])?;
        }
        addresses.ip(&["addr", "flush", "dev", interface])?;
        addresses.ip(&["link", "set", interface, "up"])?;
        Ok(addresses)
    }

    /// One more pod uses `ip`; added to the interface for the first.
    pub(super) fn acquire(&self, ip: IpAddr) -> Result<()> {
        let mut users = self.users.lock().unwrap_or_else(|e| e.into_inner());
        if users.add(ip) {
            let added = self.ip(&["addr", "add", &host_prefix(ip), "dev", &self.interface]);
            if added.is_err() {
                users.remove(ip);
            }
            added?;
        }
        Ok(())
    }

    /// One pod less uses `ip`; removed from the interface with the last.
    pub(super) fn release(&self, ip: IpAddr) -> Result<()> {
        let mut users = self.users.lock().unwrap_or_else(|e| e.into_inner());
        if users.remove(ip) {
            self.ip(&["addr", "del", &host_prefix(ip), "dev", &self.interface])?;
        }
        Ok(())
    }

    /// Deletes the interface, and its addresses with it.
    pub(super) fn delete(&self) -> Result<()> {
        self.ip(&["link", "delete", &self.interface])
    }

    fn ip(&self, args: &[&str]) -> Result<()> {
        run(Command::new("ip").args(["-n", &self.netns]).args(args))
    }
}

/// Runs `cmd` to completion; an error carrying its standard error if it failed.
fn run(cmd: &mut Command) -> Result<()> {
    let describe = format!("{cmd:?}");
    let out = cmd.output().context(|| format!("running {describe}"))?;
    if !out.status.success() {
        return Err(Error::Command {
            command: describe,
            status: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(())
}

fn host_prefix(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{v4}/32"),
        IpAddr::V6(v6) => format!("{v6}/128"),
    }
}

/// How many running pods use each address. Pure.
#[derive(Debug, Default)]
struct Users(BTreeMap<IpAddr, usize>);

impl Users {
    /// Counts a user; whether it is the first (the address is to be added).
    fn add(&mut self, ip: IpAddr) -> bool {
        let count = self.0.entry(ip).or_default();
        *count += 1;
        *count == 1
    }

    /// Forgets a user; whether it was the last (the address is to be removed). An
    /// address nobody uses is left alone.
    fn remove(&mut self, ip: IpAddr) -> bool {
        match self.0.get_mut(&ip) {
            Some(1) => {
                self.0.remove(&ip);
                true
            }
            Some(count) => {
                *count -= 1;
                false
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_lives_while_a_pod_uses_it() {
        let a: IpAddr = "10.101.0.7".parse().unwrap();
        let shared: IpAddr = "127.0.0.1".parse().unwrap();
        let mut users = Users::default();
        assert!(users.add(a));
        assert!(users.add(shared));
        assert!(!users.add(shared));
        assert!(!users.remove(shared));
        assert!(users.remove(shared));
        assert!(!users.remove(shared), "already gone");
        assert!(users.remove(a));
        assert!(users.add(a), "added anew");
    }

    #[test]
    fn host_prefixes() {
        assert_eq!(host_prefix("10.101.0.7".parse().unwrap()), "10.101.0.7/32");
        assert_eq!(host_prefix("fd00::7".parse().unwrap()), "fd00::7/128");
    }
}
