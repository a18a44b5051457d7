//! The registry's answers, classified once for every caller.

use oci_client::errors::{OciDistributionError, OciErrorCode};

use crate::credentials::CredentialsError;

/// Why a registry request failed. The text names the image, never a credential.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("invalid image reference {image:?}: {reason}")]
    InvalidReference { image: String, reason: String },
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    #[error("registry refused the credentials for {image}: {detail}")]
    Unauthorized { image: String, detail: String },
    #[error("{image} not found in the registry: {detail}")]
    NotFound { image: String, detail: String },
    #[error("{image}: {detail}")]
    Registry { image: String, detail: String },
}

impl RegistryError {
    /// Classifies what `oci-client` returned for `image`.
    pub fn from_client(image: &str, error: OciDistributionError) -> Self {
        let detail = error_chain(&error);
        let image = image.to_string();
        let any_code = |codes: &[OciErrorCode]| match &error {
            OciDistributionError::RegistryError { envelope, .. } => {
                envelope.errors.iter().any(|e| codes.contains(&e.code))
            }
            _ => false,
        };
        match error {
            OciDistributionError::AuthenticationFailure(_)
            | OciDistributionError::UnauthorizedError { .. }
            | OciDistributionError::ServerError {
                code: 401 | 403, ..
            } => Self::Unauthorized { image, detail },
            OciDistributionError::ImageManifestNotFoundError(_)
            | OciDistributionError::ServerError { code: 404, .. } => {
                Self::NotFound { image, detail }
            }
            _ if any_code(&[
                OciErrorCode::ManifestUnknown,
                OciErrorCode::NameUnknown,
                OciErrorCode::BlobUnknown,
            ]) =>
            {
                Self::NotFound { image, detail }
            }
            _ if any_code(&[OciErrorCode::Unauthorized, OciErrorCode::Denied]) => {
                Self::Unauthorized { image, detail }
            }
            _ => Self::Registry { image, detail },
        }
    }

    /// The registry answered that the image (or its repository) does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::NotFound { .. })
    }

    /// The registry refused the credentials, or the credentials cannot be read.
    pub fn is_unauthorized(&self) -> bool {
        matches!(self, Self::Unauthorized { .. } | Self::Credentials(_))
    }
}

/// An error and its sources on one line.
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}
