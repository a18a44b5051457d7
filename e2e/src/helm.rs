//! `charts/kmm-fleet` beside `addon-manifests/`: renders both with the real programs
//! (`helm template` from the toolchain's helm, `kubectl kustomize` from its kubectl) and
//! compares the results object by object, as parsed objects: comments, key order and
//! quoting do not count, every value does.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::{Error, IoContext, Result};

/// `charts/kmm-fleet/`.
pub fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/kmm-fleet")
}

/// `addon-manifests/`: `hub` is the base the README installs, `monitoring` the opt-in.
pub fn manifests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../addon-manifests")
}

/// What names one object in a cluster.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ObjectKey {
    pub api_version: String,
    pub kind: String,
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} ", self.api_version, self.kind)?;
        if !self.namespace.is_empty() {
            write!(f, "{}/", self.namespace)?;
        }
        f.write_str(&self.name)
    }
}

/// Parsed objects by key.
pub type Objects = BTreeMap<ObjectKey, Value>;

/// Every object of a multi-document YAML stream (empty documents skipped); two objects
/// with one key are an error, as the second would hide the first in a comparison.
pub fn parse(what: &str, yaml: &str) -> Result<Objects> {
    let mut objects = Objects::new();
    for document in serde_yaml_ng::Deserializer::from_str(yaml) {
        let object: Value = serde::Deserialize::deserialize(document)
            .map_err(|e| Error::Invalid(format!("{what}: {e}")))?;
        if object.is_null() {
            continue;
        }
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        let key = ObjectKey {
            api_version: text(&object["apiVersion"]),
            kind: text(&object["kind"]),
            namespace: text(&object["metadata"]["namespace"]),
            name: text(&object["metadata"]["name"]),
        };
        if key.kind.is_empty() || key.name.is_empty() {
            return Err(Error::Invalid(format!(
                "{what}: an object without kind or name: {object}"
            )));
        }
        if objects.contains_key(&key) {
            return Err(Error::Invalid(format!("{what}: {key} twice")));
        }
        objects.insert(key, object);
    }
    Ok(objects)
}

/// `helm template <release> charts/kmm-fleet --include-crds` with `values` (a values
/// file's content; `{}` for the defaults). The CRDs are included: the chart ships them
/// in `crds/`, where `helm template` leaves them out by default.
pub fn render_chart(helm: &Path, release: &str, values: &Value) -> Result<Objects> {
    let file = tempfile::Builder::new()
        .suffix(".json")
        .tempfile()
        .context(|| "creating a values file".into())?;
    // JSON is YAML: helm reads it as a values file, with no --set parsing of types.
    std::fs::write(file.path(), values.to_string())
        .context(|| format!("writing {}", file.path().display()))?;
    let mut cmd = Command::new(helm);
    cmd.args(["template", release])
        .arg(chart_dir())
        .args(["--include-crds", "--values"])
        .arg(file.path());
    parse("helm template", &output(&mut cmd)?)
}

/// `kubectl kustomize` of each directory, together (one object in two is an error).
pub fn render_kustomize(kubectl: &Path, dirs: &[&Path]) -> Result<Objects> {
    let mut objects = Objects::new();
    for dir in dirs {
        let mut cmd = Command::new(kubectl);
        cmd.arg("kustomize").arg(dir);
        let rendered = parse(
            &format!("kubectl kustomize {}", dir.display()),
            &output(&mut cmd)?,
        )?;
        for (key, object) in rendered {
            if objects.insert(key.clone(), object).is_some() {
                return Err(Error::Invalid(format!(
                    "kubectl kustomize: {key} is in more than one of {dirs:?}"
                )));
            }
        }
    }
    Ok(objects)
}

/// `helm lint --strict` of the chart: messages on stdout, failure as an error.
pub fn lint(helm: &Path) -> Result<String> {
    let mut cmd = Command::new(helm);
    cmd.args(["lint", "--strict"]).arg(chart_dir());
    output(&mut cmd)
}

/// Which side of a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Left,
    Right,
}

/// One way two renders differ.
#[derive(Debug, Clone, PartialEq)]
pub enum Difference {
    /// An object only one side has.
    Only { side: Side, key: ObjectKey },
    /// A field of an object both have (a JSON pointer), with each side's value; `None`
    /// where that side lacks it.
    Field {
        key: ObjectKey,
        path: String,
        left: Option<Value>,
        right: Option<Value>,
    },
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |v: &Option<Value>| v.as_ref().map_or("(absent)".to_owned(), Value::to_string);
        match self {
            Self::Only { side, key } => write!(f, "{key}: only on the {side:?} side"),
            Self::Field {
                key,
                path,
                left,
                right,
            } => write!(f, "{key} {path}: {} | {}", show(left), show(right)),
        }
    }
}

/// Every difference between `left` and `right`, objects in key order, fields in
/// document order.
pub fn compare(left: &Objects, right: &Objects) -> Vec<Difference> {
    let mut differences = vec![];
    for (key, l) in left {
        match right.get(key) {
            Some(r) => diff_values(key, "", l, r, &mut differences),
            None => differences.push(Difference::Only {
                side: Side::Left,
                key: key.clone(),
            }),
        }
    }
    for key in right.keys().filter(|k| !left.contains_key(k)) {
        differences.push(Difference::Only {
            side: Side::Right,
            key: key.clone(),
        });
    }
    differences
}

fn diff_values(key: &ObjectKey, path: &str, l: &Value, r: &Value, into: &mut Vec<Difference>) {
    let field = |path: String, left: Option<&Value>, right: Option<&Value>| Difference::Field {
        key: key.clone(),
        path,
        left: left.cloned(),
        right: right.cloned(),
    };
    match (l, r) {
        (Value::Object(lm), Value::Object(rm)) => {
            for (k, lv) in lm {
                let at = format!("{path}/{}", escape(k));
                match rm.get(k) {
                    Some(rv) => diff_values(key, &at, lv, rv, into),
                    None => into.push(field(at, Some(lv), None)),
                }
            }
            for (k, rv) in rm.iter().filter(|(k, _)| !lm.contains_key(*k)) {
                into.push(field(format!("{path}/{}", escape(k)), None, Some(rv)));
            }
        }
        (Value::Array(la), Value::Array(ra)) => {
            for i in 0..la.len().max(ra.len()) {
                let at = format!("{path}/{i}");
                match (la.get(i), ra.get(i)) {
                    (Some(lv), Some(rv)) => diff_values(key, &at, lv, rv, into),
                    (lv, rv) => into.push(field(at, lv, rv)),
                }
            }
        }
        _ if l != r => into.push(field(path.to_owned(), Some(l), Some(r))),
        _ => {}
    }
}

/// A JSON pointer's escaping of one key (RFC 6901): label keys hold `/`.
fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// The value at a JSON pointer of an object, for assertions on a render.
pub fn field<'a>(objects: &'a Objects, key: &ObjectKey, pointer: &str) -> Result<&'a Value> {
    objects
        .get(key)
        .ok_or_else(|| Error::Invalid(format!("no {key} in the render")))?
        .pointer(pointer)
        .ok_or_else(|| Error::Invalid(format!("{key} has no {pointer}")))
}

fn output(cmd: &mut Command) -> Result<String> {
    let described = format!(
        "{} {}",
        cmd.get_program().to_string_lossy(),
        cmd.get_args()
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let out = cmd.output().context(|| format!("running {described}"))?;
    if !out.status.success() {
        return Err(Error::Command {
            command: described,
            status: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    String::from_utf8(out.stdout)
        .map_err(|e| Error::Invalid(format!("{described} printed no UTF-8: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn objects(yaml: &str) -> Objects {
        parse("test", yaml).unwrap()
    }

    #[test]
    fn differences_name_the_object_and_the_field_path() {
        let left = objects(
            "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: n, labels: {app.kubernetes.io/name: a}}\nspec: {ports: [{port: 443}]}\n---\napiVersion: v1\nkind: ConfigMap\nmetadata: {name: only-left}\n",
        );
        let right = objects(
            "# comments and key order do not count\napiVersion: v1\nkind: Service\nmetadata: {namespace: n, name: a, labels: {app.kubernetes.io/name: b}}\nspec: {ports: [{port: 443, nodePort: 30443}], type: NodePort}\n",
        );
        let found: Vec<String> = compare(&left, &right)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(
            found,
            [
                "v1 ConfigMap only-left: only on the Left side",
                "v1 Service n/a /metadata/labels/app.kubernetes.io~1name: \"a\" | \"b\"",
                "v1 Service n/a /spec/ports/0/nodePort: (absent) | 30443",
                "v1 Service n/a /spec/type: (absent) | \"NodePort\"",
            ]
        );
        assert!(compare(&left, &left).is_empty());
    }

    #[test]
    fn a_string_is_not_a_number_and_empty_documents_are_skipped() {
        let left = objects("---\napiVersion: v1\nkind: A\nmetadata: {name: x}\nv: \"1\"\n---\n");
        let right = objects("apiVersion: v1\nkind: A\nmetadata: {name: x}\nv: 1\n");
        assert_eq!(compare(&left, &right).len(), 1);
        let key = left.keys().next().unwrap().clone();
        assert_eq!(field(&left, &key, "/v").unwrap(), &json!("1"));
    }

    #[test]
    fn an_object_twice_is_refused() {
        let twice = "apiVersion: v1\nkind: A\nmetadata: {name: x}\n---\napiVersion: v1\nkind: A\nmetadata: {name: x}\n";
        assert!(parse("test", twice).is_err());
    }
}
