//! `kubectl agentrun submit TEMPLATE -p name=value …`: a run created from
//! an AgentRunTemplate (D21), as the caller — admission checks the caller's
//! rights for everything the run uses (D17), whoever wrote the template.

use std::collections::BTreeMap;

use agentrun_api::{AgentRun, AgentRunTemplate, labels, parse_param, render};
use kube::Client;
use kube::api::{Api, ObjectMeta, PostParams};

use crate::client::{Error, api};

/// What `submit` was asked.
#[derive(clap::Args, Debug, Clone)]
pub struct SubmitArgs {
    /// The AgentRunTemplate, in the namespace.
    pub template: String,
    /// A parameter, `name=value` (repeatable): an integer, `true`/`false`, JSON
    /// for an object parameter, the text itself for a string.
    #[arg(short = 'p', long = "param", value_name = "NAME=VALUE")]
    pub params: Vec<String>,
    /// The run's name (default: TEMPLATE-<random>).
    #[arg(long)]
    pub name: Option<String>,
    /// Print the run that would be created, and create nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// The run `args` asks for from `template`: its spec rendered, labelled
/// with the template's name.
pub fn run_from(template: &AgentRunTemplate, args: &SubmitArgs) -> Result<AgentRun, Error> {
    let name = template.metadata.name.clone().unwrap_or_default();
    let mut given = BTreeMap::new();
    for p in &args.params {
        let (k, v) = p
            .split_once('=')
            .ok_or_else(|| Error::Usage(format!("-p {p}: give a parameter as NAME=VALUE")))?;
        let declared = template
            .spec
            .params
            .iter()
            .find(|d| d.name == k)
            .ok_or_else(|| {
                let names: Vec<&str> = template
                    .spec
                    .params
                    .iter()
                    .map(|d| d.name.as_str())
                    .collect();
                Error::Usage(format!(
                    "template {name} declares no parameter {k} (it declares: {})",
                    if names.is_empty() {
                        "none".to_owned()
                    } else {
                        names.join(", ")
                    }
                ))
            })?;
        if given.contains_key(k) {
            return Err(Error::Usage(format!("-p {k} is given twice")));
        }
        let value = parse_param(declared, v).map_err(|e| Error::Usage(e.to_string()))?;
        given.insert(k.to_owned(), value);
    }
    let spec =
        render(template, &given).map_err(|e| Error::Refused(format!("template {name}: {e}")))?;
    let mut run_labels = template.metadata.labels.clone().unwrap_or_default();
    run_labels.insert(labels::TEMPLATE.to_owned(), name.clone());
    Ok(AgentRun {
        metadata: ObjectMeta {
            name: args.name.clone(),
            generate_name: args.name.is_none().then(|| format!("{name}-")),
            namespace: template.metadata.namespace.clone(),
            labels: Some(run_labels),
            ..ObjectMeta::default()
        },
        spec,
        status: None,
    })
}

pub async fn submit(client: &Client, ns: &str, args: &SubmitArgs) -> Result<(), Error> {
    let template = Api::<AgentRunTemplate>::namespaced(client.clone(), ns)
        .get(&args.template)
        .await
        .map_err(api(format!("reading AgentRunTemplate {}", args.template)))?;
    let run = run_from(&template, args)?;
    if args.dry_run {
        print!(
            "{}",
            serde_yaml::to_string(&run).map_err(|e| Error::Usage(e.to_string()))?
        );
        return Ok(());
    }
    let created = Api::<AgentRun>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &run)
        .await
        .map_err(api(format!(
            "creating a run from AgentRunTemplate {}",
            args.template
        )))?;
    let t = created.spec.template.as_deref();
    println!(
        "agentrun {} created from template {} (generation {}){}",
        created.metadata.name.as_deref().unwrap_or_default(),
        args.template,
        t.map_or(0, |t| t.generation),
        t.filter(|t| !t.params.is_empty())
            .map_or(String::new(), |t| {
                let shown: Vec<String> = t.params.iter().map(|(k, v)| format!("{k}={v}")).collect();
                format!(" with {}", shown.join(" "))
            })
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn template() -> AgentRunTemplate {
        serde_json::from_value(json!({
            "apiVersion": "agentrun.dev/v1alpha1", "kind": "AgentRunTemplate",
            "metadata": {"name": "refund", "namespace": "shop", "generation": 2,
                         "labels": {"team": "payments"}},
            "spec": {
                "params": [{"name": "orderId", "type": "integer", "required": true},
                           {"name": "dryRun", "type": "boolean", "default": false}],
                "run": {"steps": [{"name": "refund", "container": {"image": "agent:1",
                    "args": ["--order={{ params.orderId }}", "--dry-run={{ params.dryRun }}"]}}]},
            },
        }))
        .unwrap()
    }

    fn args(params: &[&str]) -> SubmitArgs {
        SubmitArgs {
            template: "refund".into(),
            params: params.iter().map(|p| (*p).to_owned()).collect(),
            name: None,
            dry_run: false,
        }
    }

    #[test]
    fn a_run_from_a_template_is_rendered_named_and_labelled() {
        let run = run_from(&template(), &args(&["orderId=4711"])).unwrap();
        assert_eq!(run.metadata.generate_name.as_deref(), Some("refund-"));
        assert_eq!(run.metadata.namespace.as_deref(), Some("shop"));
        let l = run.metadata.labels.unwrap();
        assert_eq!(
            (l["team"].as_str(), l[labels::TEMPLATE].as_str()),
            ("payments", "refund")
        );
        let c = run.spec.steps[0].container.as_ref().unwrap();
        assert_eq!(c.args, ["--order=4711", "--dry-run=false"]);
        let t = run.spec.template.unwrap();
        assert_eq!((t.name.as_str(), t.generation), ("refund", 2));
    }

    #[test]
    fn bad_parameters_are_refused_before_anything_is_created() {
        for (p, want) in [
            (vec!["orderId"], "give a parameter as NAME=VALUE"),
            (
                vec!["order=1"],
                "declares no parameter order (it declares: orderId, dryRun)",
            ),
            (vec!["orderId=x"], "\"x\" is not an integer"),
            (vec!["orderId=1", "orderId=2"], "-p orderId is given twice"),
            (vec![], "parameter orderId is required"),
        ] {
            let e = run_from(&template(), &args(&p)).unwrap_err().to_string();
            assert!(e.contains(want), "{p:?}: {e}");
        }
    }
}
