//! The CRDs checked in under `crds/` are exactly what the types generate.

#[test]
fn checked_in_crds_match_the_types() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/crds/agentrun.dev_crds.yaml");
    let on_disk = std::fs::read_to_string(path).expect("crds/agentrun.dev_crds.yaml exists");
    let generated = agentrun_operator::api::crds_yaml();
    assert!(
        on_disk == generated,
        "crds/agentrun.dev_crds.yaml is stale: run `make crds` and commit the result"
    );
}
