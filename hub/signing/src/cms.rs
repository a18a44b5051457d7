//! The DER of the one CMS shape a module signature uses (RFC 5652): a detached
//! `SignedData`, no certificates, one `SignerInfo` without signed attributes. Written
//! the way OpenSSL's `i2d_CMS_ContentInfo` writes it for `sign-file`: definite lengths,
//! no parameters in the digest algorithm identifier, a NULL one in `rsaEncryption`'s.

use crate::module::HashAlgorithm;

const SEQUENCE: u8 = 0x30;
const SET: u8 = 0x31;
const INTEGER: u8 = 0x02;
const OCTET_STRING: u8 = 0x04;
/// `[0] EXPLICIT`, constructed: `ContentInfo.content`.
const CONTEXT_0: u8 = 0xa0;

/// OID 1.2.840.113549.1.7.2, signedData.
const SIGNED_DATA: &[u8] = &[
    0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x07, 0x02,
];
/// OID 1.2.840.113549.1.7.1, data: the (detached) content's type.
const DATA: &[u8] = &[
    0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x07, 0x01,
];
/// AlgorithmIdentifier { rsaEncryption (1.2.840.113549.1.1.1), NULL }.
const RSA_ENCRYPTION: &[u8] = &[
    0x30, 0x0d, 0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01, 0x05, 0x00,
];
/// `version 1`, as both SignedData and SignerInfo carry it when the signer is named
/// by issuer and serial number.
const VERSION_1: &[u8] = &[INTEGER, 0x01, 0x01];

fn push_len(out: &mut Vec<u8>, len: usize) {
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes = len.to_be_bytes();
        let skip = bytes.iter().take_while(|&&b| b == 0).count();
        out.push(0x80 | (bytes.len() - skip) as u8);
        out.extend_from_slice(&bytes[skip..]);
    }
}

fn tlv(tag: u8, parts: &[&[u8]]) -> Vec<u8> {
    let len = parts.iter().map(|p| p.len()).sum();
    let mut out = Vec::with_capacity(len + 6);
    out.push(tag);
    push_len(&mut out, len);
    for part in parts {
        out.extend_from_slice(part);
    }
    out
}

/// `IssuerAndSerialNumber` from the issuer's `Name` DER and the serial number's
/// big-endian magnitude (non-negative).
pub(crate) fn issuer_and_serial(issuer: &[u8], serial: &[u8]) -> Vec<u8> {
    let digits = match serial.iter().position(|&b| b != 0) {
        Some(first) => &serial[first..],
        None => &[][..],
    };
    // DER INTEGER: minimal two's complement, so a leading 1 bit needs a zero byte.
    let serial = match digits.first() {
        None => tlv(INTEGER, &[&[0]]),
        Some(&b) if b & 0x80 != 0 => tlv(INTEGER, &[&[0], digits]),
        Some(_) => tlv(INTEGER, &[digits]),
    };
    tlv(SEQUENCE, &[issuer, &serial])
}

/// `ContentInfo { signedData, SignedData { ... } }` for `signature`, made by `signer`
/// over the content's `hash` digest.
pub(crate) fn signed_data(hash: HashAlgorithm, signer: &[u8], signature: &[u8]) -> Vec<u8> {
    let digest_algorithm = tlv(SEQUENCE, &[hash.oid()]);
    let signer_info = tlv(
        SEQUENCE,
        &[
            VERSION_1,
            signer,
            &digest_algorithm,
            RSA_ENCRYPTION,
            &tlv(OCTET_STRING, &[signature]),
        ],
    );
    let content = tlv(
        SEQUENCE,
        &[
            VERSION_1,
            &tlv(SET, &[&digest_algorithm]),
            &tlv(SEQUENCE, &[DATA]),
            &tlv(SET, &[&signer_info]),
        ],
    );
    tlv(SEQUENCE, &[SIGNED_DATA, &tlv(CONTEXT_0, &[&content])])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_use_the_shortest_form() {
        assert_eq!(tlv(OCTET_STRING, &[&[7; 3]])[..2], [0x04, 3]);
        assert_eq!(tlv(OCTET_STRING, &[&[7; 127]])[..2], [0x04, 127]);
        assert_eq!(tlv(OCTET_STRING, &[&[7; 128]])[..3], [0x04, 0x81, 128]);
        assert_eq!(tlv(OCTET_STRING, &[&[7; 256]])[..4], [0x04, 0x82, 1, 0]);
        assert_eq!(
            tlv(OCTET_STRING, &[&vec![7; 70_000]])[..5],
            [0x04, 0x83, 0x01, 0x11, 0x70]
        );
    }

    #[test]
    fn serial_numbers_are_minimal_positive_integers() {
        let name = [SEQUENCE, 0];
        let serial = |s: &[u8]| issuer_and_serial(&name, s)[4..].to_vec();
        assert_eq!(serial(&[]), [INTEGER, 1, 0]);
        assert_eq!(serial(&[0, 0]), [INTEGER, 1, 0]);
        assert_eq!(serial(&[0x7f, 1]), [INTEGER, 2, 0x7f, 1]);
        assert_eq!(serial(&[0x80]), [INTEGER, 2, 0, 0x80]);
        assert_eq!(serial(&[0, 0x12]), [INTEGER, 1, 0x12]);
    }
}
