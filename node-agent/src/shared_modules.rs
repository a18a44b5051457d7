//! Unloading one served module without pulling a kernel module out from under another.
//! Pure.
//!
//! Two modules the agent serves may need the same kernel module: one loads it by name,
//! another loads a module that depends on it. `modprobe -r` removes a module and then
//! every dependency left unused, so unloading the second would remove the first's module;
//! and removing a module another one uses fails ("in use") on every retry. When the
//! module being unloaded shares anything with another served module, the agent plans the
//! removals itself: one kernel module at a time, never one that another served module
//! needs (a module it named, or a dependency of one), dependencies only once nothing uses
//! them. What is kept is reported; the unload completes as far as it safely can.

use std::collections::{BTreeMap, BTreeSet};

use crate::plan::normalize_module_name;

/// Every loaded kernel module and the loaded modules that use it (`/proc/modules`'s
/// "used by" column).
pub type Users = BTreeMap<String, BTreeSet<String>>;

/// The kernel modules a served module needs: those it loaded by name and their
/// dependencies, transitively.
pub fn needed(users: &Users, named: &[String]) -> BTreeSet<String> {
    let mut needed = BTreeSet::new();
    let mut next: Vec<String> = named.iter().map(|m| normalize_module_name(m)).collect();
    while let Some(module) = next.pop() {
        if !users.contains_key(&module) || !needed.insert(module.clone()) {
            continue;
        }
        next.extend(dependencies(users, &module));
    }
    needed
}

/// The loaded modules `module` uses.
fn dependencies(users: &Users, module: &str) -> Vec<String> {
    users
        .iter()
        .filter(|(_, by)| by.contains(module))
        .map(|(dependency, _)| dependency.clone())
        .collect()
}

/// A kernel module left loaded because other served modules need it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Kept {
    pub module: String,
    /// The served modules (their keys) that need it.
    pub needed_by: Vec<String>,
}

/// How to unload a served module that shares kernel modules with others.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Removal {
    /// Kernel modules to remove, one at a time (without their dependencies), in order.
    pub remove: Vec<String>,
    /// What stays for the others.
    pub kept: Vec<Kept>,
}

/// Why the unload cannot proceed: a module is used by one no served module accounts for
/// (as `modprobe -r` would say).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("modprobe: FATAL: Module {module} is in use (by {}).", by.join(", "))]
pub struct InUse {
    pub module: String,
    pub by: Vec<String>,
}

/// The removals that unload `named` (the module's kernel modules in load order), keeping
/// what `others` (each served module's key and what it needs, see [`needed`]) need.
/// `None` when nothing is shared: plain `modprobe -r` is then exactly right.
pub fn plan_removal(
    users: &Users,
    named: &[String],
    others: &[(String, BTreeSet<String>)],
) -> Option<Result<Removal, InUse>> {
    let mut protected: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (key, needs) in others {
        for module in needs {
            protected.entry(module).or_default().push(key.clone());
        }
    }
    let ours = needed(users, named);
    if !ours.iter().any(|m| protected.contains_key(m.as_str())) {
        return None;
    }
    let mut planner = Planner {
        users: users.clone(),
        protected,
        removal: Removal::default(),
    };
    for module in named.iter().rev().map(|m| normalize_module_name(m)) {
        if let Err(in_use) = planner.remove(&module) {
            return Some(Err(in_use));
        }
    }
    Some(Ok(planner.removal))
}

struct Planner<'a> {
    users: Users,
    protected: BTreeMap<&'a str, Vec<String>>,
    removal: Removal,
}

impl Planner<'_> {
    fn keep(&mut self, module: &str, needed_by: Vec<String>) {
        if !self.removal.kept.iter().any(|k| k.module == module) {
            self.removal.kept.push(Kept {
                module: module.to_owned(),
                needed_by,
            });
        }
    }

    fn remove(&mut self, module: &str) -> Result<(), InUse> {
        let Some(by) = self.users.get(module) else {
            return Ok(()); // gone already
        };
        if let Some(keys) = self.protected.get(module) {
            let keys = keys.clone();
            self.keep(module, keys);
            return Ok(());
        }
        if !by.is_empty() {
            if by
                .iter()
                .any(|user| !self.protected.contains_key(user.as_str()))
            {
                return Err(InUse {
                    module: module.to_owned(),
                    by: by.iter().cloned().collect(),
                });
            }
            let mut needed_by: Vec<String> = by
                .iter()
                .filter_map(|user| self.protected.get(user.as_str()))
                .flatten()
                .cloned()
                .collect();
            needed_by.sort();
            needed_by.dedup();
            self.keep(module, needed_by);
            return Ok(());
        }
        let dependencies = dependencies(&self.users, module);
        self.users.remove(module);
        for by in self.users.values_mut() {
            by.remove(module);
        }
        self.removal.remove.push(module.to_owned());
        for dependency in dependencies {
            if let Some(keys) = self.protected.get(dependency.as_str()) {
                let keys = keys.clone();
                self.keep(&dependency, keys);
            } else if self.users.get(&dependency).is_some_and(BTreeSet::is_empty) {
                self.remove(&dependency)?;
            }
        }
        Ok(())
    }
}

/// Parses `/proc/modules` into [`Users`]: `name size refcount used,by, state address`.
pub fn parse_users(proc_modules: &str) -> Users {
    proc_modules
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let name = fields.next()?.to_owned();
            let by = fields
                .nth(2)
                .unwrap_or("-")
                .split(',')
                .filter(|u| !u.is_empty() && *u != "-")
                .map(str::to_owned)
                .collect();
            Some((name, by))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The README's module: `kmm_hello_dep` uses `kmm_hello`.
    fn hello_loaded() -> Users {
        parse_users(
            "kmm_hello 16384 1 kmm_hello_dep, Live 0x0000000000000000 (O)\n\
             kmm_hello_dep 16384 0 - Live 0x0000000000000000 (O)\n",
        )
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    fn other(key: &str, users: &Users, named: &[&str]) -> (String, BTreeSet<String>) {
        (key.to_owned(), needed(users, &names(named)))
    }

    #[test]
    fn proc_modules_give_each_module_its_users() {
        let users = hello_loaded();
        assert_eq!(
            users["kmm_hello"],
            BTreeSet::from(["kmm_hello_dep".to_owned()])
        );
        assert!(users["kmm_hello_dep"].is_empty());
        assert_eq!(
            needed(&users, &names(&["kmm-hello-dep"])),
            BTreeSet::from(["kmm_hello".to_owned(), "kmm_hello_dep".to_owned()])
        );
    }

    #[test]
    fn nothing_shared_leaves_the_unload_to_modprobe() {
        let users = hello_loaded();
        assert_eq!(plan_removal(&users, &names(&["kmm_hello_dep"]), &[]), None);
    }

    #[test]
    fn deselecting_the_module_that_shares_a_kernel_module_keeps_it_for_the_other() {
        let users = hello_loaded();
        let others = [other(
            "drivers/kmm-hello",
            &users,
            &["kmm_hello_dep", "kmm_hello"],
        )];
        let removal = plan_removal(&users, &names(&["kmm_hello"]), &others)
            .unwrap()
            .unwrap();
        assert!(removal.remove.is_empty(), "{removal:?}");
        assert_eq!(
            removal.kept,
            [Kept {
                module: "kmm_hello".into(),
                needed_by: vec!["drivers/kmm-hello".into()],
            }]
        );
    }

    #[test]
    fn unloading_the_other_way_round_never_pulls_the_shared_dependency() {
        let users = hello_loaded();
        let others = [other("drivers/second", &users, &["kmm_hello"])];
        let removal = plan_removal(&users, &names(&["kmm_hello_dep", "kmm_hello"]), &others)
            .unwrap()
            .unwrap();
        assert_eq!(removal.remove, ["kmm_hello_dep"]);
        assert_eq!(removal.kept[0].module, "kmm_hello");
    }

    #[test]
    fn unused_dependencies_go_as_modprobe_would_take_them() {
        let users = parse_users(
            "top 1 0 - Live 0x0\n\
             mid 1 1 top, Live 0x0\n\
             base 1 2 mid,other, Live 0x0\n\
             other 1 0 - Live 0x0\n",
        );
        let others = [other("drivers/other", &users, &["other"])];
        let removal = plan_removal(&users, &names(&["top"]), &others)
            .unwrap()
            .unwrap();
        assert_eq!(removal.remove, ["top", "mid"]);
        assert_eq!(removal.kept[0].module, "base");
    }

    #[test]
    fn a_user_no_served_module_accounts_for_blocks_the_unload() {
        let users = parse_users(
            "ours 1 1 foreign, Live 0x0\n\
             foreign 1 0 - Live 0x0\n\
             shared 1 1 ours, Live 0x0\n",
        );
        let others = [(
            "drivers/b".to_owned(),
            BTreeSet::from(["shared".to_owned()]),
        )];
        assert_eq!(
            plan_removal(&users, &names(&["ours"]), &others),
            Some(Err(InUse {
                module: "ours".into(),
                by: vec!["foreign".into()],
            }))
        );
    }
}
