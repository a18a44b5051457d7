//! Schema fragments that the derive cannot express.

use schemars::{Schema, SchemaGenerator, json_schema};

/// An object kept verbatim: the apiserver stores whatever fields it has.
pub(crate) fn preserve_unknown_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}
