use openssl::ec::{EcGroup, EcKey};
use openssl::nid::Nid;
use openssl::pkey::PKey;
use openssl::symm::Cipher;

use super::shared;
use openssl::bn::BigNum;

use super::support::{TestKey, self_signed, self_signed_with_serial, test_key};
use crate::{KeyError, SigningKey};

/// Pieces of the private key an error or a `Debug` output must never show: each
/// base64 line of its PEM, and the start of every private RSA component in hex and
/// decimal.
fn secrets(test: &TestKey) -> Vec<String> {
    let pem = String::from_utf8(test.key_pem.clone()).unwrap();
    let mut out: Vec<String> = pem
        .lines()
        .filter(|l| !l.starts_with("-----"))
        .map(|l| l[..16.min(l.len())].to_string())
        .collect();
    let rsa = test.key.rsa().unwrap();
    let private = [
        rsa.d(),
        rsa.p().unwrap(),
        rsa.q().unwrap(),
        rsa.dmp1().unwrap(),
        rsa.dmq1().unwrap(),
        rsa.iqmp().unwrap(),
    ];
    for n in private {
        let hex = n.to_hex_str().unwrap().to_string();
        out.push(hex[..16].to_string());
        out.push(hex[..16].to_lowercase());
        out.push(n.to_dec_str().unwrap()[..16].to_string());
    }
    out
}

fn assert_no_secrets(text: &str, test: &TestKey) {
    for secret in secrets(test) {
        assert!(
            !text.contains(&secret),
            "{text:?} contains key material {secret:?}"
        );
    }
}

fn refused(key: &[u8], cert: &[u8]) -> KeyError {
    SigningKey::from_pem(key, cert).expect_err("the key must be refused")
}

#[test]
fn a_key_and_its_certificate_in_pem_or_der_are_accepted() {
    let (test, _) = shared();
    let der = test.cert.to_der().unwrap();
    let key = SigningKey::from_pem(&test.key_pem, &der).unwrap();
    assert_eq!(
        key.subject(),
        "O=kmm-fleet tests, CN=kmm-signing unit tests"
    );
    // The kernel's `signing_key.pem` holds the key and the certificate in one file.
    let mut both = test.cert_pem.clone();
    both.extend_from_slice(&test.key_pem);
    SigningKey::from_pem(&both, &both).unwrap();
    // PKCS#1 (`BEGIN RSA PRIVATE KEY`) as well as PKCS#8.
    let pkcs1 = test.key.rsa().unwrap().private_key_to_pem().unwrap();
    assert!(pkcs1.starts_with(b"-----BEGIN RSA PRIVATE KEY-----"));
    SigningKey::from_pem(&pkcs1, &test.cert_pem).unwrap();
}

#[test]
fn a_key_that_does_not_match_the_certificate_is_refused() {
    let (test, _) = shared();
    let other = test_key(2048, "someone else");
    let err = refused(&test.key_pem, &other.cert_pem);
    assert!(matches!(err, KeyError::Mismatch { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("keySecret key `key`"), "{text}");
    assert!(text.contains("certSecret key `cert`"), "{text}");
    assert!(text.contains("CN=someone else"), "{text}");
    assert_no_secrets(&text, test);
    assert_no_secrets(&format!("{err:?}"), test);
}

#[test]
fn a_non_rsa_key_is_refused() {
    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
    let key = PKey::from_ec_key(EcKey::generate(&group).unwrap()).unwrap();
    let cert = self_signed(&key, "an ECDSA key").to_pem().unwrap();
    let err = refused(&key.private_key_to_pem_pkcs8().unwrap(), &cert);
    assert!(matches!(err, KeyError::NotRsa { .. }), "{err:?}");
    assert!(err.to_string().contains("ECDSA"), "{err}");
    assert!(err.to_string().contains("keySecret key `key`"), "{err}");
}

#[test]
fn garbage_is_refused_naming_the_secret_key_at_fault() {
    let (test, _) = shared();
    for garbage in [
        &b""[..],
        b"not a key",
        b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
    ] {
        let err = refused(garbage, &test.cert_pem);
        assert!(matches!(err, KeyError::Key { .. }), "{err:?}");
        assert!(err.to_string().contains("keySecret key `key`"), "{err}");
        let err = refused(&test.key_pem, garbage);
        assert!(matches!(err, KeyError::Certificate { .. }), "{err:?}");
        assert!(err.to_string().contains("certSecret key `cert`"), "{err}");
        assert_no_secrets(&err.to_string(), test);
    }
    // The certificate where the key belongs, and the key where the certificate does.
    let err = refused(&test.cert_pem, &test.cert_pem);
    assert!(matches!(err, KeyError::Key { .. }), "{err:?}");
    let err = refused(&test.key_pem, &test.key_pem);
    assert!(matches!(err, KeyError::Certificate { .. }), "{err:?}");
    assert_no_secrets(&err.to_string(), test);
    assert_no_secrets(&format!("{err:?}"), test);
}

#[test]
fn a_damaged_key_is_refused_without_showing_it() {
    let (test, _) = shared();
    // One base64 character changed halfway through the key lands in its private
    // exponent: still a well-formed key, with the certificate's public part, whose
    // signatures would all be wrong. One changed in the first line breaks the DER.
    let pem = &test.key_pem;
    let body = pem.iter().position(|&b| b == b'\n').unwrap() + 1;
    for (at, inconsistent) in [(pem.len() / 2, true), (body + 5, false)] {
        let mut damaged = pem.clone();
        damaged[at] = if damaged[at] == b'A' { b'B' } else { b'A' };
        let err = refused(&damaged, &test.cert_pem);
        if inconsistent {
            assert!(matches!(err, KeyError::Inconsistent { .. }), "{err:?}");
        } else {
            assert!(matches!(err, KeyError::Key { .. }), "{err:?}");
        }
        assert!(err.to_string().contains("keySecret key `key`"), "{err}");
        assert_no_secrets(&err.to_string(), test);
        assert_no_secrets(&format!("{err:?}"), test);
    }
}

#[test]
fn an_encrypted_key_is_refused_without_a_prompt() {
    let (test, _) = shared();
    let encrypted = test
        .key
        .private_key_to_pem_pkcs8_passphrase(Cipher::aes_256_cbc(), b"secret")
        .unwrap();
    let err = refused(&encrypted, &test.cert_pem);
    assert!(matches!(err, KeyError::EncryptedKey), "{err:?}");
    assert!(err.to_string().contains("keySecret key `key`"), "{err}");
    // The traditional form says so in a header instead.
    let traditional = test
        .key
        .rsa()
        .unwrap()
        .private_key_to_pem_passphrase(Cipher::aes_128_cbc(), b"secret")
        .unwrap();
    assert!(matches!(
        refused(&traditional, &test.cert_pem),
        KeyError::EncryptedKey
    ));
}

#[test]
fn debug_shows_the_certificate_not_the_key() {
    let (test, key) = shared();
    let debug = format!("{key:?}");
    assert!(debug.contains("CN=kmm-signing unit tests"), "{debug}");
    assert!(debug.contains("2048"), "{debug}");
    assert_no_secrets(&debug, test);
    assert_no_secrets(&format!("{key:#?}"), test);
}

#[test]
fn a_certificate_with_a_negative_serial_is_refused() {
    let (test, _) = shared();
    let serial = BigNum::from_dec_str("-4711").unwrap();
    let cert = self_signed_with_serial(&test.key, "negative", &serial);
    let err = refused(&test.key_pem, &cert.to_pem().unwrap());
    assert!(matches!(err, KeyError::NegativeSerial), "{err:?}");
    assert!(err.to_string().contains("certSecret key `cert`"), "{err}");
    // Zero is not negative: a one-byte INTEGER 0 names the signer.
    let zero = self_signed_with_serial(&test.key, "zero", &BigNum::from_u32(0).unwrap());
    SigningKey::from_pem(&test.key_pem, &zero.to_pem().unwrap()).unwrap();
}
