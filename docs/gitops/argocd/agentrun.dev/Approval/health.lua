-- Argo CD health of an agentrun.dev Approval (docs/gitops/README.md).
-- Suspended: it waits for a person. Healthy: approved (or, for a Reconcile
-- approval, decided). Degraded: rejected or expired, so its step does not run.
-- Written for gopher-lua (Lua 5.1), as Argo CD runs it.
local hs = {}
local phase = obj.status and obj.status.phase
if phase == nil or phase == "Pending" then
  hs.status = "Suspended"
  local question = (obj.spec and obj.spec.question) or ""
  hs.message = "Waiting for a decision: " .. question
  if obj.status ~= nil and obj.status.votes ~= nil and obj.spec ~= nil and (obj.spec.quorum or 1) > 1 then
    hs.message = hs.message .. " (" .. obj.status.votes .. " approving votes)"
  end
  if obj.spec ~= nil and obj.spec.expiresAt ~= nil then
    hs.message = hs.message .. " (expires " .. obj.spec.expiresAt .. ")"
  end
  return hs
end
local by = (obj.status.decidedBy and (" by " .. obj.status.decidedBy)) or ""
if phase == "Approved" then
  hs.status = "Healthy"
  hs.message = "Approved" .. by
  return hs
end
if phase == "Rejected" then
  hs.status = "Degraded"
  hs.message = "Rejected" .. by
  return hs
end
if phase == "Expired" then
  hs.status = "Degraded"
  hs.message = "Expired without a decision"
  return hs
end
-- A Reconcile approval's answers (Retry, MarkSucceeded, MarkFailed) and any
-- phase a newer operator adds: decided, nothing left to wait for.
hs.status = "Healthy"
hs.message = phase .. by
return hs
