#[path = "../tests/support/mod.rs"]
mod support;

mod key;
mod layers;
mod module;

use std::sync::OnceLock;

use support::{TestKey, test_key};

use crate::SigningKey;

/// One RSA 2048 key for every test that does not care which key it is.
fn shared() -> &'static (TestKey, SigningKey) {
    static KEY: OnceLock<(TestKey, SigningKey)> = OnceLock::new();
    KEY.get_or_init(|| {
        let test = test_key(2048, "kmm-signing unit tests");
        let key = SigningKey::from_pem(&test.key_pem, &test.cert_pem).unwrap();
        (test, key)
    })
}
