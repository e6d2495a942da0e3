//! How the operator writes to the API server: under its own name, and what
//! an answer's status code says.

use kube::api::PatchParams;

use crate::labels;

/// A patch by the operator, named as its writer in the object's
/// `managedFields` (an unnamed one is listed as `unknown`).
pub(super) fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(labels::FIELD_MANAGER.into()),
        ..Default::default()
    }
}

/// Whether the API server answered `err` with HTTP status `code`.
pub(super) fn is_status(err: &kube::Error, code: u16) -> bool {
    matches!(err, kube::Error::Api(s) if s.code == code)
}
