-- Argo CD health of an agentrun.dev AgentRun (docs/gitops/README.md).
-- Healthy: it succeeded, or it is a run created again (a re-sync after its
-- TTL) that found the record of the run that already ran, and ran nothing
-- (phase AlreadyRan, D18). Degraded: it failed, was cancelled, or cannot
-- progress by itself (Stalled=True). Suspended: it waits for a person
-- (an Approval) or spec.suspend is set. Progressing: anything else,
-- including a spec change the operator has not seen yet.
-- Written for gopher-lua (Lua 5.1), as Argo CD runs it.
local hs = {}
local function condition(status, type)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == type then
      return c
    end
  end
  return nil
end
local status = obj.status
if status == nil or status.phase == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to pick up the run"
  return hs
end
local generation = obj.metadata and obj.metadata.generation
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end
local succeeded = condition(status, "Succeeded")
local phase = status.phase
if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = (succeeded and succeeded.message ~= "" and succeeded.message) or "Succeeded"
  return hs
end
if phase == "AlreadyRan" then
  local ready = condition(status, "Ready")
  hs.status = "Healthy"
  hs.message = (ready and ready.message ~= "" and ready.message) or "Already ran"
  return hs
end
if phase == "Failed" or phase == "Cancelled" then
  hs.status = "Degraded"
  local why = phase
  if succeeded ~= nil and succeeded.reason ~= nil then
    why = phase .. " (" .. succeeded.reason .. ")"
  end
  if succeeded ~= nil and succeeded.message ~= nil and succeeded.message ~= "" then
    why = why .. ": " .. succeeded.message
  end
  hs.message = why
  return hs
end
local stalled = condition(status, "Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = "Stalled (" .. (stalled.reason or "") .. "): " .. (stalled.message or "")
  return hs
end
if phase == "WaitingForApproval" then
  local waiting = condition(status, "AwaitingApproval")
  hs.status = "Suspended"
  hs.message = (waiting and waiting.message ~= "" and waiting.message) or "Waiting for an Approval"
  return hs
end
if obj.spec ~= nil and obj.spec.suspend == true then
  hs.status = "Suspended"
  hs.message = "Suspended (spec.suspend)"
  return hs
end
hs.status = "Progressing"
hs.message = phase .. ", " .. (status.progress or "0/0") .. " steps done"
return hs
